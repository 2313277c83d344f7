"""algorithm.prox_logp_method: where the loss's log pi_prox comes from, given what the old-log-prob strategy gave.

    recompute  exact: the strategy's old log-probs (a pass over slot 0), or, where it returned None (pi_old is the
               live weights), the training forward pass's own log-probs, detached.
    loglinear  AReaL's approximation (dppo.algo.loglinear_prox_log_prob) from the training forward's detached
               log-probs and the behavior log-probs: no snapshot and no forward pass of its own.
    metrics    recompute, plus the error loglinear would have made against those exact log-probs
               (prox_approx/abs_err_mean|max, prox_approx/is_weight_abs_err_mean|max over valid tokens).

A method's prox() is either a tensor (B, R) known before the update, or a ProxFn that the update calls on each
micro-batch's detached log-probs (dppo.workers.actor.update.decoupled_objective). Versions are counted in optimizer
steps (StepVersions). The math lives in dppo.algo; this module only picks the inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dppo.algo import UnknownNameError, loglinear_prox_log_prob, prox_approx_metrics
from dppo.config.choices import PROX_LOGP_METHODS
from dppo.rollout import TrainBatch

# prox(logp (b, R) of the training forward, detached; sl: the micro-batch's rows of the batch) -> log pi_prox (b, R)
ProxFn = Callable[[torch.Tensor, slice], torch.Tensor]

@dataclass(frozen=True)
class StepVersions:
    """The optimizer-step counts of loglinear's three policies at one trigger."""

    v_prox: int  # steps taken at the cycle start (pi_prox)
    v_theta: int  # v_prox + trigger (the weights being trained)
    v_behav: torch.Tensor  # (B,) long: steps of the weights that sampled each row

    @classmethod
    def of(cls, batch: TrainBatch, version: int, trigger: int, parameter_sync_step: int) -> StepVersions:
        """version: the trainer's policy version (sync cycles) at the cycle start; a group's version likewise."""
        v_prox = int(version) * parameter_sync_step
        v_behav = batch.versions[batch.group_index] * parameter_sync_step  # (B,)
        return cls(v_prox, v_prox + int(trigger), v_behav)


def live_prox(logp: torch.Tensor, sl: slice) -> torch.Tensor:
    """pi_prox is the weights being trained: their log-probs, detached (no separate pass)."""
    return logp


def loglinear_prox(batch: TrainBatch, steps: StepVersions) -> ProxFn:
    """ProxFn of loglinear_prox_log_prob over batch's rows."""

    def prox(logp: torch.Tensor, sl: slice) -> torch.Tensor:
        return loglinear_prox_log_prob(logp, batch.behav_logp[sl], batch.response_mask[sl], v_prox=steps.v_prox,
                                       v_theta=steps.v_theta, v_behav=steps.v_behav[sl])  # fmt: skip

    return prox


class Recompute:
    name = "recompute"

    def prox(self, old_logp: torch.Tensor | None, batch: TrainBatch, steps: StepVersions) -> torch.Tensor | ProxFn:
        return live_prox if old_logp is None else old_logp

    def metrics(self, logp: torch.Tensor, prox_logp: torch.Tensor, batch: TrainBatch,
                steps: StepVersions) -> dict[str, float]:  # fmt: skip
        """Metrics of the step from the training forward's log-probs logp (B, R) and the prox the loss used."""
        return {}


class Loglinear(Recompute):
    name = "loglinear"

    def prox(self, old_logp: torch.Tensor | None, batch: TrainBatch, steps: StepVersions) -> ProxFn:
        return loglinear_prox(batch, steps)


class Metrics(Recompute):
    name = "metrics"

    def metrics(self, logp, prox_logp, batch, steps) -> dict[str, float]:
        approx = loglinear_prox(batch, steps)(logp, slice(None))  # (B, R)
        return prox_approx_metrics(approx, prox_logp, batch.behav_logp, batch.response_mask)


_METHODS = {cls.name: cls for cls in (Recompute, Loglinear, Metrics)}
assert tuple(_METHODS) == PROX_LOGP_METHODS


def make_prox_method(name: str) -> Recompute:
    """The method named name (one of PROX_LOGP_METHODS; the config has checked it)."""
    if name not in _METHODS:
        raise UnknownNameError(f"unknown algorithm.prox_logp_method {name!r}; valid names: {', '.join(_METHODS)}")
    return _METHODS[name]()
