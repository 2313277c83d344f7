"""What dppo asks of a rollout engine apart from sampling: its EngineSpec, and the EngineSettings it is built from.

An engine module declares one EngineSpec next to its engine class (hf.SPEC, vllm.SPEC); rollout.name names it
(dppo.workers.rollout.engines.registry resolves the name). The start-up checks, the memory estimate, the precision
decision, the delta publisher and `dppo eval` ask the spec, never the name. An engine is built from EngineSettings,
resolved once from the run's config (dppo.workers.rollout.engine_config): no engine reads the config itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class EngineSettings:
    """Everything an engine is built from besides the model's transformers config and its device."""

    dtype: str  # the engine's dtype: rollout.dtype, else model.dtype (never auto: decided before the run starts)
    temperature: float  # rollout.temperature: the sampling temperature, and that of the behavior log-probs
    max_new_tokens: int  # rollout.max_new_tokens, else the prompt source's response length
    eos_token: int | None  # the source's: a response ends after it (None: every response is max_new_tokens long)
    pad_token: int  # the source's: responses are padded with it after their end
    max_prompt_len: int  # the source's longest prompt, in tokens
    rows: int  # the rows one batch of the engine holds (batch_rows): what an engine that sizes its buffers sizes
    micro_batch_size: int  # actor.micro_batch_size: rows per forward pass where the engine scores log-probs itself
    partial_chunk: int  # rollout.partial_chunk: decode steps between two calls of a sample's refresh
    weight_sync: str  # rollout.weight_sync: full, or delta where the spec accepts_delta
    enforce_eager: bool | None  # rollout.enforce_eager: true runs eagerly, false compiles; null: the engine's choice


def batch_rows(n: int, groups_per_batch: int, groups_per_trigger: int) -> int:
    """The rows an engine runs in one batch: a ticket's, rollout.groups_per_batch groups (separate_async), or a
    trigger's groups (sync), whichever is more, rollout.n samples each."""
    return max(groups_per_batch, groups_per_trigger) * n


@dataclass(frozen=True)
class WorkerLoad:
    """A run as an engine's memory estimate sees it (dppo.launch.memory_estimate builds it from the run's plan)."""

    params: int  # the model's parameters (a tied tensor once)
    layers: int  # transformer layers
    kv_width: int  # key-value heads x head size
    vocab_size: int
    sequence_len: int  # the longest prompt plus the longest response, in tokens
    dtype_bytes: int  # bytes of an element of the engine's dtype
    rows: int  # EngineSettings.rows
    weight_sync: str  # rollout.weight_sync
    process_bytes: int  # a worker process with torch and transformers imported, before any model


def nothing_missing() -> str | None:
    """check_installed of an engine that needs nothing beyond dppo's own dependencies."""
    return None


def no_setup_problem(rollout: Any, model: Any) -> str | None:
    """check_setup of an engine that runs wherever the hf engine does."""
    return None


@dataclass(frozen=True)
class EngineSpec:
    """An engine's declarations: its name, how to build it, and what the run's start-up and the trainer need to know
    of it before one exists. A frozen value, not a class to subclass: the run's plan holds it, and a user's engine
    declares only the fields that differ from the defaults (those of an engine like hf: it needs nothing installed,
    holds a transformers model copy, loads full weights, computes on its worker's device).

    build(settings, model_config, device): a new engine for a worker (model_config: the trainer model's transformers
    config; the weights arrive later with load_weights; device: the worker's, its GPU where Ray gave it one).
    check_installed(): None, or one line saying what is missing from this Python and what to run to get it.
    check_setup(rollout, model): None, or one line saying why the engine cannot run the config's rollout and model
    sections on this machine (asked after check_installed passed).
    worker_bytes(load): what one worker process holds with this engine, by part ("process", "weights", "kv cache
    and logits", ...); None: dppo.launch.memory_estimate's count of a worker that holds a transformers model copy,
    generates with a KV cache and scores its log-probs with a forward pass (the hf engine's).
    accepts_delta: with rollout.weight_sync=delta the trainer publishes, next to the full weights, what changed
    (dppo.workers.weight_delta), and the engine's load_delta applies it; False: weight_sync=delta loads full weights.
    uses_visible_gpu: the engine computes on a GPU its process sees even where the worker got none of the rollout's
    pool (vLLM picks it itself): rollout.dtype=auto then judges that GPU's bf16 (dppo.launch.precision).
    """

    name: str
    build: Callable[[EngineSettings, Any, torch.device], Any]  # -> a RolloutEngine (base.py imports this module)
    check_installed: Callable[[], str | None] = nothing_missing
    check_setup: Callable[[Any, Any], str | None] = no_setup_problem
    worker_bytes: Callable[[WorkerLoad], dict[str, int]] | None = None
    accepts_delta: bool = False
    uses_visible_gpu: bool = False
