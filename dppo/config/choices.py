"""The names each config key accepts, and the decisions made from the config alone (before any model exists): where
a run's prompts come from. pi_old's names (algorithm.prox_logp_method, snapshot.strategy) are dppo.pi_old_names', and
which pi_old a run uses is dppo.config.pi_old's choice. The workers and the driver both ask here, so the config needs
nothing from either."""

from __future__ import annotations

import re

TRAINER_MODES = ("separate_async", "sync")
EVAL_ENGINES = ("policy", "rollout")
PROX_ANCHORS = ("cycle_start", "current")
OFF_POLICY_STRATEGIES = ("drop", "wait")
DEVICES = ("cpu", "cuda", "auto")
# model.dtype, rollout.dtype: dppo.models.DTYPES maps each to its torch dtype (the names here, without torch, are what the
# config accepts; tests/unit/config/test_config_imports.py checks the two agree)
DTYPES = ("float32", "bfloat16", "float16")
FSDP_MODES = ("auto", "always")
MIXED_PRECISIONS = ("bfloat16",)  # actor.mixed_precision (dppo.workers.actor.precision)
# actor.mixed_precision and rollout.dtype: bf16 where this machine computes it faster, decided before a run starts
# (dppo.launch.precision); the config only holds the word, and what runs gets a concrete value
PRECISION_AUTO = "auto"
LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")  # trainer.logger (dppo.trainer.trackers)
SAVE_CONTENTS = ("model", "optimizer", "extra", "hf_model")  # actor.checkpoint.save_contents
# rollout.name's builtin engines: the registry (dppo.workers.rollout.engines.registry), name -> "module:attribute" of
# the engine's EngineSpec, imported only when a run asks for it (vLLM is installed in .venv-vllm only). A new engine is
# its module and one line here. Any other rollout.name is a class path, package.module:Class, of the user's own.
ROLLOUT_ENGINES = {
    "hf": "dppo.workers.rollout.engines.hf:SPEC",
    "vllm": "dppo.workers.rollout.engines.vllm:SPEC",
}
WEIGHT_SYNC_MODES = ("full", "delta")  # rollout.weight_sync
PROMPT_SOURCES = ("task", "parquet", "reasoning_gym")  # data.source (dppo.data.make_prompt_source builds each)
LR_SCHEDULER_TYPES = ("constant", "cosine")  # actor.optim.lr_scheduler_type (dppo.workers.actor.lr_schedule)
# algorithm.filter_groups.metric names of each response's reward (verl 0.9.1's "reward"; "score" and "seq_reward" are
# verl's older DAPO names of the same); any other name is a key of the reward function's extra outputs
FILTER_REWARD_METRICS = ("reward", "score", "seq_reward")

# rollout.name of a user's engine: package.module:Class (checked for its form only: the class is imported by the run's
# start-up, dppo.launch.preflight, through dppo.workers.rollout.engines.registry)
ENGINE_CLASS_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


def prompt_source_kind(source: str | None, train_files: object) -> str:
    """Where a run's prompts come from (data.source; null: parquet when data.train_files is set, else task), from
    the config's values (a DppoConfig's, or a checkpoint's config dict's)."""
    if source is not None:
        return source
    return "parquet" if train_files is not None else "task"
