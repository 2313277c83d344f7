"""What the rollout workers and the engines get of a run's config, read from it once, on the driver's side: an engine's
EngineSettings (engine_settings: a worker's engine, the trainer's evaluation engine, `dppo eval`'s) and a worker's
RolloutWorkerSettings (worker_settings). The workers and the engines receive these, never the config."""

from __future__ import annotations

from dppo.algo_names import GREEDY_BASELINE_ESTIMATORS
from dppo.config import DppoConfig
from dppo.data.source import PromptSource
from dppo.workers.rollout.engines import EngineSettings, batch_rows
from dppo.workers.rollout.worker import RolloutWorkerSettings, generation_step_bytes


def engine_settings(cfg: DppoConfig, source: PromptSource) -> EngineSettings:
    """The settings of cfg's engine (its keys are rollout.*, its batch comes from the trainer's and its scoring
    micro-batch from the actor's) for source's prompts (their lengths and tokens)."""
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


def worker_settings(cfg: DppoConfig, source: PromptSource, model_config) -> RolloutWorkerSettings:
    """What each rollout worker of cfg reads, for source's prompts and model_config's model (the policy's transformers
    config: its vocabulary bounds one generate() call's memory)."""
    r = cfg.rollout
    return RolloutWorkerSettings(
        engine_name=r.name,
        engine=engine_settings(cfg, source),
        seed=cfg.trainer.seed,
        n=r.n,
        temperature=r.temperature,
        max_new_tokens=r.max_new_tokens or source.response_length,
        groups_per_batch=r.groups_per_batch,
        num_threads=r.num_threads,
        partial_rollout=r.partial_rollout,
        verify_sync=r.verify_sync,
        greedy_baseline=cfg.algorithm.adv_estimator in GREEDY_BASELINE_ESTIMATORS,
        agent=r.agent,
        step_bytes=generation_step_bytes(r, cfg.actor.micro_batch_size, model_config.vocab_size),
    )
