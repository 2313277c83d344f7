"""algorithm.prox_logp_method: where the loss's log pi_prox comes from, given what the pi_old source gave
(dppo.workers.actor.pi_old_sources).

    recompute  exact: the source's old log-probs (a pass over slot 0), or, where it returned None (pi_old is the
               live weights), the training forward pass's own log-probs, detached.
    loglinear  AReaL's approximation (dppo.algo.loglinear_prox_log_prob) from the training forward's detached
               log-probs and the behavior log-probs: no snapshot and no forward pass of its own.
    metrics    recompute, plus the error loglinear would have made against those exact log-probs
               (prox_approx/abs_err_mean|max, prox_approx/is_weight_abs_err_mean|max over valid tokens).
    auto       metrics on check cycles, loglinear between: dppo.workers.actor.prox_auto's switch decides from the
               checks' measured IS-weight error (prox_approx/method: 0 loglinear, 1 recompute); between the checks
               exact_this_cycle() is False and the source computes nothing.

A method's prox() is either a tensor (B, R) known before the update, or a ProxFn that the update calls on each
micro-batch's detached log-probs (dppo.workers.actor.update.decoupled_objective). Versions are counted in optimizer
steps (StepVersions). The math lives in dppo.algo; this module only picks the inputs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dppo.algo import loglinear_alpha, loglinear_prox_log_prob, prox_approx_metrics
from dppo.config.pi_old import PiOldChoice
from dppo.batch import TrainBatch
from dppo.workers.actor.prox_auto import INTERP_KEY, METHOD_CODES, AutoProxSwitch

# prox(logp (b, R) of the training forward, detached; sl: the micro-batch's rows of the batch) -> log pi_prox (b, R)
ProxFn = Callable[[torch.Tensor, slice], torch.Tensor]


@dataclass(frozen=True)
class StepVersions:
    """The optimizer-step counts of loglinear's three policies at one trigger.

    Within the cycle v_theta counts only the updates applied: a trigger skipped by actor.max_ppo_kl (or a non-finite
    gradient) left the weights where they were, and loglinear interpolating as if they had moved would put pi_prox
    between pi_behav and weights that are pi_prox's own. Across cycles a version counts parameter_sync_step steps
    whatever was skipped in it: the skips of earlier cycles are not kept (that would take every version's applied
    count back to the oldest token's, in every checkpoint); a skipped step there only overstates how far pi_prox is
    from pi_behav, and the guard skips steps rarely."""

    v_prox: int  # steps taken at the cycle start (pi_prox)
    v_theta: int  # v_prox + the cycle's updates applied before this trigger (the weights being trained)
    v_behav: torch.Tensor  # (B, R) long: steps of the weights that sampled each token (rollout.partial_rollout: a
    # response may span several versions)
    step: int  # v_prox + trigger: the trigger's optimizer step, applied or not (seeds the losses that draw tokens)

    @classmethod
    def of(
        cls, batch: TrainBatch, version: int, trigger: int, parameter_sync_step: int, skipped: int = 0
    ) -> StepVersions:
        """version: the trainer's policy version (sync cycles) at the cycle start; a token's version likewise.
        skipped: the cycle's triggers before this one whose update was not applied."""
        v_prox = int(version) * parameter_sync_step
        v_behav = batch.behav_versions() * parameter_sync_step  # (B, R)
        return cls(v_prox, v_prox + int(trigger) - int(skipped), v_behav, v_prox + int(trigger))


def live_prox(logp: torch.Tensor, sl: slice) -> torch.Tensor:
    """pi_prox is the weights being trained: their log-probs, detached (no separate pass)."""
    return logp


def loglinear_prox(batch: TrainBatch, steps: StepVersions) -> ProxFn:
    """ProxFn of loglinear_prox_log_prob over batch's rows."""

    def prox(logp: torch.Tensor, sl: slice) -> torch.Tensor:
        return loglinear_prox_log_prob(
            logp,
            batch.behav_logp[sl],
            batch.response_mask[sl],
            v_prox=steps.v_prox,
            v_theta=steps.v_theta,
            v_behav=steps.v_behav[sl],
        )

    return prox


class ProxMethod(ABC):
    """How the loss gets log pi_prox from what the pi_old source gave (one class per algorithm.prox_logp_method)."""

    name = ""

    def exact_this_cycle(self) -> bool:
        """Whether this cycle's loss uses the source's exact old log-probs (else nothing is computed for it: no
        snapshot, no pass). Asked after begin_trigger."""
        return True

    @abstractmethod
    def prox(self, old_logp: torch.Tensor | None, batch: TrainBatch, steps: StepVersions) -> torch.Tensor | ProxFn:
        """log pi_prox (B, R) of batch, or a ProxFn of the training forward; old_logp: the source's (None: the
        training forward's own, or nothing computed)."""

    def metrics(
        self, logp: torch.Tensor, prox_logp: torch.Tensor, batch: TrainBatch, steps: StepVersions
    ) -> dict[str, float]:
        """Metrics of the step from the training forward's log-probs logp (B, R) and the prox the loss used."""
        return {}

    def begin_trigger(self, trigger: int) -> None:
        """Called before anything else of a trigger's update (auto closes a cycle at trigger 0)."""

    def record(self, merged: dict[str, float]) -> dict[str, float]:
        """The trigger's metrics merged over the ranks (the same on every rank); returns metrics to add."""
        return {}

    def state(self) -> dict:
        """What a checkpoint must keep of this method across cycles (plain values; the same on every rank)."""
        return {}

    def load_state(self, state: dict) -> None:
        """Continue from state() of a checkpointed run ({} : a fresh run, or a checkpoint without it)."""


class Recompute(ProxMethod):
    name = "recompute"

    def prox(self, old_logp: torch.Tensor | None, batch: TrainBatch, steps: StepVersions) -> torch.Tensor | ProxFn:
        return live_prox if old_logp is None else old_logp


class Loglinear(ProxMethod):
    name = "loglinear"

    def exact_this_cycle(self) -> bool:
        return False

    def prox(self, old_logp: torch.Tensor | None, batch: TrainBatch, steps: StepVersions) -> ProxFn:
        return loglinear_prox(batch, steps)


class Metrics(Recompute):
    name = "metrics"

    def metrics(self, logp, prox_logp, batch, steps) -> dict[str, float]:
        approx = loglinear_prox(batch, steps)(logp, slice(None))  # (B, R)
        metrics = prox_approx_metrics(approx, prox_logp, batch.behav_logp, batch.response_mask)
        return {**metrics, INTERP_KEY: interpolated_share(batch, steps)}


def interpolated_share(batch: TrainBatch, steps: StepVersions) -> float:
    """The share of the batch's valid tokens that loglinear interpolates (0 < alpha < 1: sampled before the cycle
    start, trained at a trigger k >= 1); elsewhere it is exact by construction. 0.0 without valid tokens."""
    alpha = loglinear_alpha(steps.v_prox, steps.v_theta, steps.v_behav)  # (B, R)
    interpolated = ((alpha > 0) & (alpha < 1)).to(batch.response_mask.device)  # (B, R)
    valid = batch.response_mask.sum()
    return float((batch.response_mask & interpolated).sum() / valid) if valid else 0.0


class Auto(ProxMethod):
    """Metrics on the switch's check cycles (the exact pi_prox, and loglinear's error against it), Loglinear
    between, where the source computes nothing (exact_this_cycle is False)."""

    name = "auto"

    def __init__(self, switch: AutoProxSwitch) -> None:
        self.switch = switch
        self._started = False

    def _current(self) -> ProxMethod:
        return Metrics() if self.switch.is_check_cycle() else Loglinear()

    def exact_this_cycle(self) -> bool:
        return self.switch.is_check_cycle()

    def prox(self, old_logp, batch, steps):
        return self._current().prox(old_logp, batch, steps)

    def metrics(self, logp, prox_logp, batch, steps) -> dict[str, float]:
        return self._current().metrics(logp, prox_logp, batch, steps)

    def begin_trigger(self, trigger: int) -> None:
        if trigger == 0 and self._started:
            self.switch.end_cycle()  # decides this cycle's method from the last one's checks
        self._started = True

    def record(self, merged: dict[str, float]) -> dict[str, float]:
        """prox_approx/method, prox_approx/checked, and on a check cycle prox_approx/check_is_err_max: the worst
        trigger's mean IS-weight error so far (a step's record keeps a _max key's largest: what the switch decides
        on at the end of the cycle)."""
        switch = self.switch
        switch.record_trigger(merged)
        checked = switch.is_check_cycle()
        out = {"prox_approx/method": METHOD_CODES[switch.method()], "prox_approx/checked": float(checked)}
        if checked:
            out["prox_approx/check_is_err_max"] = max(switch.cycle_errs)
        return out

    def state(self) -> dict:
        """The switch's state and whether a cycle has begun (the next trigger 0 closes it): without them a resumed
        run would start over with a check cycle, mid-way through a cycle that ran loglinear."""
        return {"started": self._started, "switch": self.switch.state()}

    def load_state(self, state: dict) -> None:
        if state:
            self._started = bool(state["started"])
            self.switch.load_state(state["switch"])


# one method per name of dppo.pi_old_names.PROX_LOGP_METHODS
PROX_METHODS: dict[str, type[ProxMethod]] = {cls.name: cls for cls in (Recompute, Loglinear, Metrics, Auto)}


def make_prox_method(choice: PiOldChoice) -> ProxMethod:
    """The method choice.method names (one of PROX_LOGP_METHODS; the choice has checked it); auto's switch is made from
    the choice's check cadence and bound, and whether stale samples can come (auto's checks must see them)."""
    if choice.method == "auto":
        return Auto(AutoProxSwitch(choice.check_every, choice.max_is_err, choice.stale_samples))
    return PROX_METHODS[choice.method]()
