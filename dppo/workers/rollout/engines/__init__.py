"""Rollout engines, chosen by rollout.name: hf (dppo's sampler, today's default) and vllm (vllm.LLM in the worker)."""

from __future__ import annotations

import torch

from dppo.config.choices import ROLLOUT_ENGINES, WEIGHT_SYNC_MODES
from dppo.workers.rollout.engines.base import Refresh, RolloutEngine, Samples, WeightSync
from dppo.workers.rollout.engines.hf import HFEngine
from dppo.workers.rollout.engines.vllm import VLLMEngine

# vLLM 0.32's CPU attention kernels (vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend.get_supported_head_sizes)
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

__all__ = [
    "ROLLOUT_ENGINES",
    "Refresh",
    "RolloutEngine",
    "Samples",
    "VLLM_CPU_HEAD_SIZES",
    "WEIGHT_SYNC_MODES",
    "WeightSync",
    "make_engine",
    "vllm_enforce_eager",
    "vllm_rows",
]


def vllm_enforce_eager(rollout, device: torch.device) -> bool:
    """rollout.enforce_eager (rollout: the config's rollout section), or where it is null, eager on the CPU only
    (compiling there costs 40-65 s per engine start and saved little work; on a GPU, CUDA graphs are vLLM's default)."""
    if rollout.enforce_eager is not None:
        return rollout.enforce_eager
    return device.type == "cpu"


def vllm_rows(rollout, groups_per_trigger: int) -> int:
    """The rows a vllm engine runs in one batch, which size its KV cache: a ticket's, rollout.groups_per_batch groups
    (separate_async) or a trigger's (sync), rollout.n samples each."""
    return max(rollout.groups_per_batch, groups_per_trigger) * rollout.n


def make_engine(cfg, source, model_config, device: torch.device = torch.device("cpu")) -> RolloutEngine:
    """The engine rollout.name names, for a worker of cfg sampling source's prompts with model_config's model, on
    device (the worker's: its GPU when Ray gave it one). vLLM picks the GPU it sees itself (Ray's
    CUDA_VISIBLE_DEVICES shows the worker its own)."""
    dtype = cfg.rollout.dtype or cfg.model.dtype
    max_new_tokens = cfg.rollout.max_new_tokens or source.response_length
    if cfg.rollout.name == "vllm":
        return VLLMEngine(
            model_config,
            dtype,
            cfg.rollout.temperature,
            max_new_tokens,
            source.eos_token,
            source.pad_token,
            weight_sync=cfg.rollout.weight_sync,
            max_num_seqs=vllm_rows(cfg.rollout, cfg.groups_per_trigger),
            max_prompt_len=source.prompt_length,
            compile=not vllm_enforce_eager(cfg.rollout, torch.device(device)),
            partial_chunk=cfg.rollout.partial_chunk,
        )
    return HFEngine(
        model_config,
        dtype,
        cfg.rollout.temperature,
        max_new_tokens,
        source.eos_token,
        source.pad_token,
        cfg.actor.micro_batch_size,
        device,
        cfg.rollout.partial_chunk,
    )
