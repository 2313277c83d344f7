"""Which pi_old a run uses: the keys that decide it, resolved once (choose_pi_old) into a frozen PiOldChoice.

Where pi_old's log-probs come from (PiOldChoice.source):

    behav      the behavior log-probs that came with the samples (algorithm.rollout_correction.bypass_mode)
    live       the weights being trained (algorithm.prox_anchor=current, or trainer.parameter_sync_step=1): the
               training forward pass's own log-probs, detached
    slot       the cycle-start weights, saved into snapshot slot 0 at trigger 0 and read by a slot reader
               (PiOldChoice.reader, snapshot.strategy) at triggers k >= 1 (Decoupled PPO)
    reference  the cycle-start weights in verl v1's blocking save-and-restore copies (snapshot.strategy=reference,
               for comparison only)
    none       no weights at all: loglinear approximates pi_old at every trigger

How the loss gets log pi_prox from that source is algorithm.prox_logp_method (PiOldChoice.method): recompute (the
source's exact values), metrics (the same, plus loglinear's error against them), loglinear (AReaL's
approximation) or auto (metrics on check cycles, loglinear between, switched by the measured error).

The choice is made once, where the run is planned (dppo.launch.plan.plan_run; the trainer's constructor for a trainer
built without a plan, as tests and benchmarks build them), and handed down as it is: the driver asks it whether
trigger 0 scores ahead (dppo.trainer.score_ahead), and each actor rank, given it by the worker group, builds its one
pi_old provider from it (dppo.workers.actor.pi_old.make_pi_old). Neither reads the keys. Combinations the config
refuses (loglinear with bypass mode, ...) are refused by dppo.config.rules before any choice is made.
"""

from __future__ import annotations

from dataclasses import dataclass

from dppo.algo_names import UnknownNameError
from dppo.pi_old_names import EXACT_METHODS, PROX_LOGP_METHODS, READER_CHOICES, SOURCES


@dataclass(frozen=True)
class PiOldChoice:
    """Everything that decides pi_old on the driver and on each actor rank."""

    source: str
    """Where pi_old's log-probs come from: one of dppo.pi_old_names.SOURCES (the module docstring)."""

    method: str = "recompute"
    """algorithm.prox_logp_method: how the loss gets log pi_prox from the source (one of PROX_LOGP_METHODS)."""

    reader: str | None = None
    """How triggers k >= 1 read slot 0 (snapshot.strategy: auto, view, swap, stream) where source == "slot"; else
    None."""

    check_every: int = 10
    """algorithm.prox_check_every: auto's cycles between two checks while loglinear runs."""

    max_is_err: float = 0.01
    """algorithm.prox_max_is_err: the largest mean IS-weight error auto lets loglinear make."""

    stale_samples: bool = True
    """Whether samples older than the cycle start can come (trainer.mode=separate_async with
    replay.max_off_policy_threshold > 0): auto's checks must then see interpolated tokens to pass."""

    score_ahead: bool = False
    """Whether trigger 0 scores the cycle's later mini-batches that have arrived with the live weights (snapshot.
    score_ahead, where they would read slot 0 otherwise: source slot and an exact method)."""

    verify: bool = False
    """trainer.verify_old_log_prob: every old log-prob the loss uses is checked against an independent copy of
    pi_old's weights."""

    fuse_live: bool = True
    """Where pi_old is the live weights, its log-probs come from the training forward pass, micro-batch by
    micro-batch; False where the rollout correction needs the whole mini-batch's first (rollout_is_batch_normalize):
    a no-grad pass of its own then."""

    device_budget_bytes: int = 0
    """snapshot.device_budget_bytes: device memory each rank's snapshot pool may use for its slots."""

    parameter_sync_step: int = 1
    """trainer.parameter_sync_step: triggers per cycle (loglinear counts versions in optimizer steps)."""

    def __post_init__(self) -> None:
        _one_of("source", self.source, SOURCES)
        _one_of("method", self.method, PROX_LOGP_METHODS)
        if self.source == "slot":
            _one_of("reader", self.reader, READER_CHOICES)
        elif self.reader is not None:
            raise ValueError(f"PiOldChoice.reader={self.reader!r} with source={self.source!r}: only a slot is read")
        if self.verify and self.source in ("behav", "none"):
            raise ValueError(
                f"PiOldChoice.source={self.source!r} computes no old log-probs: there is nothing to verify"
            )
        if self.score_ahead and (self.source != "slot" or self.method not in EXACT_METHODS):
            raise ValueError(
                f"PiOldChoice.score_ahead with source={self.source!r}, method={self.method!r}: only exact "
                "old log-probs that would read slot 0 are scored ahead"
            )

    @property
    def takes_snapshots(self) -> bool:
        """Whether the ranks keep a copy of the cycle-start weights (slot 0, or verl v1's reference copies)."""
        return self.source in ("slot", "reference")


def _one_of(field: str, value: object, names: tuple[str, ...]) -> None:
    if value not in names:
        raise UnknownNameError(f"PiOldChoice.{field}={value!r}; valid names: {', '.join(names)}")


def choose_pi_old(cfg) -> PiOldChoice:
    """The PiOldChoice of cfg (a DppoConfig that passed dppo.config.rules): the one place that reads
    algorithm.prox_anchor, prox_logp_method, prox_check_every, prox_max_is_err, rollout_correction (bypass_mode,
    rollout_is_batch_normalize), snapshot.*, trainer.verify_old_log_prob, parameter_sync_step, mode and
    replay.max_off_policy_threshold for pi_old."""
    a, t, snap = cfg.algorithm, cfg.trainer, cfg.snapshot
    rc = a.rollout_correction
    source = _source(rc.bypass_mode, a.prox_logp_method, a.prox_anchor, t.parameter_sync_step, snap.strategy)
    return PiOldChoice(
        source=source,
        method=a.prox_logp_method,
        reader=snap.strategy if source == "slot" else None,
        check_every=a.prox_check_every,
        max_is_err=a.prox_max_is_err,
        stale_samples=t.mode != "sync" and cfg.replay.max_off_policy_threshold > 0,
        score_ahead=snap.score_ahead and source == "slot" and a.prox_logp_method in EXACT_METHODS,
        verify=t.verify_old_log_prob,
        fuse_live=not (rc.rollout_is is not None and rc.rollout_is_batch_normalize),
        device_budget_bytes=snap.device_budget_bytes,
        parameter_sync_step=t.parameter_sync_step,
    )


def _source(bypass: bool, method: str, anchor: str, parameter_sync_step: int, snapshot_strategy: str) -> str:
    """Where pi_old's log-probs come from (see the module docstring), in order of precedence."""
    if bypass:
        return "behav"
    if method == "loglinear":
        return "none"
    if anchor == "current" or parameter_sync_step == 1:
        return "live"  # at parameter_sync_step 1 every trigger is a trigger 0: slot 0 would never be read
    if method == "auto" or snapshot_strategy != "reference":
        return "slot"  # auto reads slot 0 through a slot reader on its check cycles (rules refuse it with reference)
    return "reference"
