"""Rollout engines, chosen by rollout.name: hf (dppo's sampler, today's default) and vllm (vllm.LLM in the worker)."""

from __future__ import annotations

from dppo.workers.rollout.engines.base import RolloutEngine, Samples, WeightSync

ENGINES = ("hf", "vllm")
WEIGHT_SYNC_MODES = ("full", "delta")
# vLLM 0.32's CPU attention kernels (vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend.get_supported_head_sizes)
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

__all__ = ["ENGINES", "RolloutEngine", "Samples", "WEIGHT_SYNC_MODES", "WeightSync", "make_engine"]


def make_engine(cfg, source, model_config) -> RolloutEngine:
    """The engine rollout.name names, for a worker of cfg sampling source's prompts with model_config's model."""
    dtype = cfg.rollout.dtype or cfg.model.dtype
    max_new_tokens = cfg.rollout.max_new_tokens or source.response_length
    if cfg.rollout.name == "vllm":
        from dppo.workers.rollout.engines.vllm import VLLMEngine

        return VLLMEngine(model_config, dtype, cfg.rollout.temperature, max_new_tokens, source.eos_token,
                          source.pad_token, weight_sync=cfg.rollout.weight_sync)  # fmt: skip
    from dppo.workers.rollout.engines.hf import HFEngine

    return HFEngine(model_config, dtype, cfg.rollout.temperature, max_new_tokens, source.eos_token, source.pad_token,
                    cfg.actor.micro_batch_size)  # fmt: skip
