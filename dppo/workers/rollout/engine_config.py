"""The one place an engine's EngineSettings are read from a run's config: engine_settings(cfg, source), and
make_engine, which builds rollout.name's engine from them (a rollout worker's, the trainer's evaluation engine,
`dppo eval`'s). The engines themselves (dppo.workers.rollout.engines) never see the config."""

from __future__ import annotations

import torch

from dppo.workers.rollout.engines import EngineSettings, RolloutEngine, batch_rows, engine_spec


def engine_settings(cfg, source) -> EngineSettings:
    """The settings of cfg's engine (the whole config: the engine's keys are rollout.*, its batch comes from the
    trainer's and its scoring micro-batch from the actor's) for source's prompts (their lengths and tokens)."""
    r = cfg.rollout
    rows, max_prompt_len = batch_rows(r.n, r.groups_per_batch, cfg.groups_per_trigger), source.prompt_length
    max_new_tokens = r.max_new_tokens or source.response_length
    if r.agent.enabled:  # rollout.agent: the agent runs in flight at once, each a first prompt and a trajectory
        rows, max_prompt_len = min(rows, r.agent.max_concurrency), r.agent.max_prompt_length
        max_new_tokens = source.response_length  # a turn's prompt holds the turns before it: the whole trajectory
    return EngineSettings(
        dtype=r.dtype or cfg.model.dtype,
        temperature=r.temperature,
        max_new_tokens=max_new_tokens,
        eos_token=source.eos_token,
        pad_token=source.pad_token,
        max_prompt_len=max_prompt_len,
        rows=rows,
        micro_batch_size=cfg.actor.micro_batch_size,
        partial_chunk=r.partial_chunk,
        weight_sync=r.weight_sync,
        enforce_eager=r.enforce_eager,
    )


def make_engine(cfg, source, model_config, device: torch.device = torch.device("cpu")) -> RolloutEngine:
    """The engine rollout.name names, for a worker of cfg sampling source's prompts with model_config's model (the
    trainer model's transformers config; the weights arrive with load_weights), on device (the worker's)."""
    return engine_spec(cfg.rollout.name).build(engine_settings(cfg, source), model_config, torch.device(device))


def publishes_deltas(rollout) -> bool:
    """Whether the trainer publishes what changed next to the full weights (rollout: the config's rollout section):
    rollout.weight_sync=delta with an engine whose spec accepts deltas (any other loads the full weights)."""
    return rollout.weight_sync == "delta" and engine_spec(rollout.name).accepts_delta
