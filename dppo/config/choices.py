"""The names each config key accepts, and the decisions made from the config alone (before any model exists):
which old-log-prob strategy a run uses, whether the driver scores ahead, which slot readers are exact on a
sharded actor. The workers and the driver both ask here, so the config needs nothing from either."""

from __future__ import annotations

TRAINER_MODES = ("separate_async", "sync")
EVAL_ENGINES = ("policy", "rollout")
PROX_ANCHORS = ("cycle_start", "current")
OFF_POLICY_STRATEGIES = ("drop", "wait")
DEVICES = ("cpu", "cuda", "auto")
DTYPES = ("float32", "bfloat16", "float16")
FSDP_MODES = ("auto", "always")
LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")  # trainer.logger (dppo.trainer.trackers)
SAVE_CONTENTS = ("model", "optimizer", "extra", "hf_model")  # actor.checkpoint.save_contents
ROLLOUT_ENGINES = ("hf", "vllm")  # rollout.name (dppo.workers.rollout.engines implements each)
WEIGHT_SYNC_MODES = ("full", "delta")  # rollout.weight_sync
PROMPT_SOURCES = ("task", "parquet", "reasoning_gym")  # data.source (dppo.data.make_prompt_source builds each)

# algorithm.prox_logp_method (dppo.workers.actor.prox_method implements each)
PROX_LOGP_METHODS = ("recompute", "loglinear", "metrics", "auto")

# How trigger k >= 1 reads slot 0 (dppo.workers.actor.slot_readers implements each).
SLOT_READER_NAMES = ("view", "swap", "stream")

# Values of snapshot.strategy: a slot reader, "auto" (the fastest that fits) or "reference" (verl v1's scheme).
SNAPSHOT_STRATEGIES = ("auto", *SLOT_READER_NAMES, "reference")

# snapshot.strategy values that are exact on a sharded (FSDP2) actor: FSDP2 all-gathers each layer from the
# parameters it registered, not from what a forward pass is handed, so view and stream would read the live
# weights there; swap writes slot 0 into that very storage and back.
SHARDED_READERS = ("auto", "swap", "reference")


class InexactUnderShardingError(ValueError):
    """A slot reader that FSDP2 would silently bypass (it would compute with the live weights)."""


def check_reader_for_sharding(name: str) -> None:
    """InexactUnderShardingError naming `name` and the readers that work, unless it is exact under FSDP2."""
    if name not in SHARDED_READERS:
        raise InexactUnderShardingError(
            f"snapshot.strategy={name!r} is not exact on a sharded (FSDP2) actor: FSDP2 all-gathers each layer from "
            f"the parameters it registered, so the {name} reader would compute with the live weights instead of "
            f"slot 0; use one of {', '.join(SHARDED_READERS)}"
        )


def needs_whole_mini_batch(cfg) -> bool:
    """Whether cfg's rollout correction needs every old log-prob of the mini-batch before the first micro-batch's
    loss (IS batch normalization divides by the mini-batch's mean weight): then the old log-probs of the live
    weights cannot come from the training forward pass, micro-batch by micro-batch."""
    rc = cfg.algorithm.rollout_correction
    return rc.rollout_is is not None and rc.rollout_is_batch_normalize


def select_strategy_name(cfg) -> str:
    """The old-log-prob strategy cfg asks for (dppo.workers.actor.old_log_prob describes each)."""
    if cfg.algorithm.rollout_correction.bypass_mode:
        return "bypass"
    if cfg.algorithm.prox_logp_method == "loglinear":
        return "loglinear"
    if cfg.algorithm.prox_anchor == "current" or cfg.trainer.parameter_sync_step == 1:
        return "current"
    if cfg.algorithm.prox_logp_method == "auto":
        return "auto"  # cycle_start's on check cycles, loglinear's (nothing) between
    return "cycle_start_reference" if cfg.snapshot.strategy == "reference" else "cycle_start"


def score_ahead_enabled(cfg) -> bool:
    """Whether the driver scores a cycle's later mini-batches ahead at trigger 0 (snapshot.score_ahead): only
    where they would read slot 0 otherwise (the cycle_start strategy)."""
    return cfg.snapshot.score_ahead and select_strategy_name(cfg) == "cycle_start"


def prompt_source_kind(source: str | None, train_files: object) -> str:
    """Where a run's prompts come from (data.source; null: parquet when data.train_files is set, else task), from
    the config's values (a DppoConfig's, or a checkpoint's config dict's)."""
    if source is not None:
        return source
    return "parquet" if train_files is not None else "task"
