"""The config schema's trainer.*, snapshot.* and ray.*: how long a run is, where it writes, how it runs (mode, devices,
ranks), its snapshots, and the Ray cluster. One dataclass per section, a docstring per field, each section's own
rules in its __post_init__ (dppo.config.schema assembles the whole config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from dppo.config.checks import (
    check_numbers,
    nonnegative,
    one_of,
    positive,
    require,
)
from dppo.config.choices import (
    DEVICES,
    EVAL_ENGINES,
    LOGGERS,
    TRAINER_MODES,
)
from dppo.pi_old_names import SNAPSHOT_STRATEGIES


@dataclass
class TrainerConfig:
    total_steps: int = 60
    """Global steps to train; one global step is one sync cycle of parameter_sync_step optimizer steps."""

    parameter_sync_step: int = 4
    """Optimizer steps (triggers) per sync cycle; rollout weights are refreshed at the end of each cycle."""

    train_batch_size: int = 128
    """Prompt groups consumed per global step; must be a multiple of parameter_sync_step."""

    seed: int = 0
    """Seed of the model init, prompt sampling and token sampling; an integer in [0, 2**64)."""

    output_dir: str = "outputs/dppo"
    """Where metrics.jsonl, the plot, the summary and checkpoints/ are written."""

    checkpoint_every: int = 10
    """Write a checkpoint every this many global steps (0: never; if > 0 the last step is always saved, and so is
    the trainer's state when the rollout fails beyond recovery)."""

    resume: bool = False
    """Continue from the newest valid checkpoint in output_dir/checkpoints, passing over corrupt or foreign ones
    with a warning (fresh if there is none; an error if there are some but none valid); false starts fresh and
    deletes the checkpoints the earlier run recorded there, and its metrics."""

    mode: str = "separate_async"
    """separate_async: rollout workers generate while the trainer trains; sync: rollout and training in lockstep."""

    record_samples: bool = False
    """Store every trigger's groups (token ids, behaviour log-probs, versions, rewards; compressed, one file per
    trigger in output_dir/samples/) beside the schedule every run records (schedule.jsonl): `dppo replay RUN_DIR
    --samples key=value ...` then trains a fresh policy on exactly those samples under another loss (docs/replay.md)."""

    verify_old_log_prob: bool = False
    """Debug: compare the old log-probs with those of a deep copy of the anchor weights (debug/old_log_prob_max_abs_diff)."""

    eval_prompts: int = 256
    """Task runs: held-out prompts scored with greedy decoding (never sampled for training, so the task needs more
    distinct prompts than this: 10**task.length for the built-in tasks); 0 skips the eval. Text data is
    evaluated on data.val_files instead."""

    test_freq: int = -1
    """Greedy evaluation every this many global steps, its metrics in that step's line of metrics.jsonl; -1 or 0:
    only at the end (the final evaluation always runs and joins the last step's line)."""

    eval_engine: str = "policy"
    """What decodes the greedy evaluation: policy (the published weights as a model of model.dtype, through dppo's
    sampler, in the trainer's process) or rollout (an engine as rollout.name and rollout.dtype build it, in the
    trainer's process, given each evaluated version's weights: verl evaluates with its rollout engine; vllm in
    bfloat16 decoded 256 prompts x 12 tokens of a 135M model 3.7x faster than policy in float32 on one core)."""

    device: str = "auto"
    """The actor ranks' device: cpu, cuda or auto (a GPU per rank when the Ray cluster has GPUs; without Ray, cuda
    when available). Rollout workers generate on the CPU unless rollout.n_gpus_per_node gives them GPUs of their own."""

    num_threads: int = 1
    """torch intra-op threads of each actor rank (rollout workers use rollout.num_threads)."""

    nnodes: int = 1
    """Nodes the actor's ranks span (verl's key); world size = nnodes x n_gpus_per_node. Needs Ray (ray.enabled)
    above 1, and a filesystem that every node sees under trainer.output_dir (each rank writes its checkpoint shards)."""

    n_gpus_per_node: int = 1
    """Actor ranks per node (verl's key): one GPU each on CUDA; on the CPU, one process each. A world size above 1
    shards the policy with FSDP2 (see actor.fsdp)."""

    collective_timeout_s: float = 600.0
    """Timeout of every collective between the actor ranks: a rank that waits longer for the others raises
    instead of hanging (a dead rank is noticed by the driver at once)."""

    progress_bar: bool = True
    """Show the progress over global steps on stderr: a tqdm bar on a terminal; elsewhere (a log file, CI, nohup) a
    plain line every total_steps / 20 steps or 30 s, whichever comes first, without the bar's carriage returns."""

    logger: Any = field(default_factory=lambda: ["console", "jsonl"])
    """Where the metrics go (verl's key), a list: console (the progress bar and the summary) and jsonl
    (metrics.jsonl) are always on; tensorboard (output_dir/tensorboard/), wandb and mlflow need the extra
    dppo[trackers]. The same scalars as metrics.jsonl at the same global steps, the config, the final eval."""

    project_name: str = "dppo"
    """The trackers' project (verl's key): the W&B project, the MLflow experiment."""

    experiment_name: Optional[str] = None
    """The trackers' run name (verl's key): the W&B and MLflow run name; null: the tracker makes one up."""

    def __post_init__(self) -> None:
        check_numbers(self, "trainer", unbounded=("seed",))
        positive("trainer.total_steps", self.total_steps)
        positive("trainer.parameter_sync_step", self.parameter_sync_step)
        positive("trainer.train_batch_size", self.train_batch_size)
        require(0 <= self.seed < 2**64, "trainer.seed", self.seed, "an integer in [0, 2**64) (numpy and torch seeds)")
        nonnegative("trainer.checkpoint_every", self.checkpoint_every)
        one_of("trainer.mode", self.mode, TRAINER_MODES)
        one_of("trainer.eval_engine", self.eval_engine, EVAL_ENGINES)
        nonnegative("trainer.eval_prompts", self.eval_prompts)
        one_of("trainer.device", self.device, DEVICES)
        positive("trainer.num_threads", self.num_threads)
        positive("trainer.nnodes", self.nnodes)
        positive("trainer.n_gpus_per_node", self.n_gpus_per_node)
        require(
            0 < self.collective_timeout_s < float("inf"),
            "trainer.collective_timeout_s",
            self.collective_timeout_s,
            "a finite number of seconds > 0",
        )
        require(bool(self.output_dir), "trainer.output_dir", self.output_dir, "a non-empty path")
        if isinstance(self.logger, str):
            self.logger = [self.logger]  # trainer.logger=wandb: one tracker
        require(
            isinstance(self.logger, (list, tuple)),
            "trainer.logger",
            self.logger,
            f"a list of logger names, e.g. [console,wandb] (some of {', '.join(LOGGERS)})",
        )
        for name in self.logger:
            one_of("trainer.logger", name, LOGGERS)
        self.logger = list(self.logger)
        require(bool(self.project_name), "trainer.project_name", self.project_name, "a non-empty name")


@dataclass
class SnapshotConfig:
    device_budget_bytes: int = 0
    """Device memory each actor rank's snapshot pool may use for its slots, which hold that rank's shards
    (0: host slots only)."""

    strategy: str = "auto"
    """How triggers k >= 1 score with the cycle-start snapshot: auto (fastest that fits), view
    (functional_call over the slot in place: CPU weights or a device-tier slot), stream (layer by layer
    from a host slot, prefetched behind the compute), swap (pool.swapped), or reference (verl v1's
    blocking save/restore/restore, for comparison only). A sharded (FSDP2) actor takes auto, swap or reference
    only: FSDP2 gathers from its own parameters, so view and stream would read the live weights."""

    score_ahead: bool = True
    """At trigger 0 of a Decoupled PPO cycle, also take the cycle's later mini-batches that have already arrived
    (the same groups, in the same order, their triggers would take) and score them with the live weights,
    which are pi_old then: those triggers read no slot, and a cycle whose later mini-batches all arrived in
    time takes no snapshot (snapshot/scored_ahead_frac). In trainer.mode=sync the rollout generates the whole
    cycle's groups at trigger 0 (the same samples). Old log-probs and weights are bitwise those of false."""

    def __post_init__(self) -> None:
        check_numbers(self, "snapshot")
        nonnegative("snapshot.device_budget_bytes", self.device_budget_bytes)
        one_of("snapshot.strategy", self.strategy, SNAPSHOT_STRATEGIES)


@dataclass
class RayConfig:
    address: Optional[str] = None
    """Ray cluster address; null uses RAY_ADDRESS, or starts a local cluster if that is unset too."""

    enabled: Optional[bool] = None
    """null (auto): Ray where the run needs it (ray.address or RAY_ADDRESS set, an actor world size above 1, the
    rollout on GPUs, or the actor on CUDA), else false. false: no Ray, one machine's CPU: the actor's one rank in
    the trainer's process, and with trainer.mode=separate_async the rollout workers (either engine) as local
    processes beside it (with sync, the rollout inside the trainer's process); this skips
    Ray's start-up (its services and one process per role importing torch: seconds on a small machine). true:
    Ray actors for every role, a local Ray cluster if no address is given."""

    num_cpus: Optional[int] = None
    """CPUs a local Ray cluster may use (null: all)."""

    def __post_init__(self) -> None:
        check_numbers(self, "ray")
        if self.num_cpus is not None:
            positive("ray.num_cpus", self.num_cpus)
