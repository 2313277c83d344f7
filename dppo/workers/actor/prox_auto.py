"""algorithm.prox_logp_method=auto: loglinear's cost with recompute's guarantee, switched by the measured error.

Each sync cycle runs one of two methods for log pi_prox:

    loglinear  AReaL's approximation (no snapshot pass), on the cycles between checks;
    recompute  the exact log-probs, on check cycles and while the approximation is out of bounds.

A check cycle computes the exact pi_prox (so its loss uses it) and measures the error loglinear would have made
against it: the mean over valid tokens of |w_loglinear - w_exact|, w the IS weight pi_prox / pi_behav
(prox_approx/is_weight_abs_err_mean). The first cycle is a check, then every prox_check_every-th cycle while
loglinear runs; every recompute cycle is a check too (the exact log-probs are there anyway). A check whose
error (the worst over the cycle's triggers) exceeds prox_max_is_err switches to recompute from the next cycle
on; a check within the bound switches back to loglinear.

This class only decides; the auto method (dppo.workers.actor.prox_method.Auto, made with it by the pi_old provider)
asks it which method each cycle uses, tells the provider whether the cycle needs the exact pi_old, and feeds it the
trigger's merged metrics, which are the same on every rank, so every rank decides the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

IS_ERR_KEY = "prox_approx/is_weight_abs_err_mean"
INTERP_KEY = "prox_approx/interp_frac"  # share of the valid tokens loglinear interpolates (0 < alpha < 1)
METHOD_CODES = {"loglinear": 0.0, "recompute": 1.0}


@dataclass
class AutoProxSwitch:
    """The state of algorithm.prox_logp_method=auto across sync cycles."""

    check_every: int
    """algorithm.prox_check_every: cycles between two checks while loglinear runs (>= 1)."""

    max_is_err: float
    """algorithm.prox_max_is_err: the largest mean IS-weight error loglinear may make (> 0)."""

    stale_samples: bool = True
    """Whether samples older than pi_prox can come (then a check must see interpolated tokens to pass)."""

    approx_ok: bool = False
    """Whether the last check passed (False before the first: the first cycle is a check)."""

    cycles_since_check: int = 0
    cycle_errs: list[float] = field(default_factory=list)
    cycle_interp: float = 0.0  # the largest share of interpolated tokens of a trigger of the cycle

    def __post_init__(self) -> None:
        if isinstance(self.check_every, bool) or not isinstance(self.check_every, int) or self.check_every < 1:
            raise ValueError(f"algorithm.prox_check_every must be an int >= 1; got {self.check_every!r}")
        ok = isinstance(self.max_is_err, (int, float)) and not isinstance(self.max_is_err, bool)
        if not (ok and math.isfinite(self.max_is_err) and self.max_is_err > 0):
            raise ValueError(f"algorithm.prox_max_is_err must be a finite number > 0; got {self.max_is_err!r}")

    def state(self) -> dict:
        """What decides the cycles to come, as plain values (a checkpoint's)."""
        return {
            "approx_ok": self.approx_ok,
            "cycles_since_check": self.cycles_since_check,
            "cycle_errs": list(self.cycle_errs),
            "cycle_interp": self.cycle_interp,
        }

    def load_state(self, state: dict) -> None:
        """Continue from state(); the settings (check_every, max_is_err) stay this run's."""
        self.approx_ok = bool(state["approx_ok"])
        self.cycles_since_check = int(state["cycles_since_check"])
        self.cycle_errs = [float(err) for err in state["cycle_errs"]]
        self.cycle_interp = float(state["cycle_interp"])

    def is_check_cycle(self) -> bool:
        """Whether this cycle computes the exact pi_prox (and measures loglinear's error against it)."""
        return not self.approx_ok or self.cycles_since_check >= self.check_every

    def method(self) -> str:
        """The method this cycle's loss uses: recompute on a check cycle, else loglinear."""
        return "recompute" if self.is_check_cycle() else "loglinear"

    def record_trigger(self, metrics: dict[str, float]) -> None:
        """A trigger's merged metrics; on a check cycle they carry loglinear's IS-weight error."""
        if self.is_check_cycle():
            if IS_ERR_KEY not in metrics:
                raise KeyError(f"a check cycle's metrics must carry {IS_ERR_KEY}; got keys {sorted(metrics)}")
            self.cycle_errs.append(float(metrics[IS_ERR_KEY]))
            self.cycle_interp = max(self.cycle_interp, float(metrics.get(INTERP_KEY, 0.0)))

    def end_cycle(self) -> dict[str, float]:
        """Close the cycle: decide the next cycle's method. Returns prox_approx/method (0 loglinear, 1 recompute:
        the method this cycle used), prox_approx/checked, and on a check cycle prox_approx/check_is_err (the
        worst trigger's mean IS-weight error). A check passes when that error is within max_is_err and, where
        stale samples can come, some trigger interpolated."""
        checked = self.is_check_cycle()
        metrics = {"prox_approx/method": METHOD_CODES[self.method()], "prox_approx/checked": float(checked)}
        if checked and self.cycle_errs:  # a cycle without a trigger decides nothing
            err = max(self.cycle_errs)
            metrics["prox_approx/check_is_err"] = err
            self.approx_ok = err <= self.max_is_err and (self.cycle_interp > 0 or not self.stale_samples)
            self.cycles_since_check = 0
        self.cycles_since_check += 1
        self.cycle_errs, self.cycle_interp = [], 0.0
        return metrics
