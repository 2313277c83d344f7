"""Rollout-correction settings (verl's algorithm.rollout_correction keys): threshold parsing and the config.

Thresholds are accepted and refused as verl 0.9.1 does (tests/oracle check it against verl's parser), except
that dppo also refuses what verl lets through to nonsense: NaN or infinite bounds, numbers written with "_"
digit separators (verl would read "0.5_1_0" as the band [0.5, 10]), a rollout_is_threshold of None while
rollout_is is set (verl then silently applies no weights), and an invalid threshold whose option is off.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType

KEY_PREFIX = "algorithm.rollout_correction"
IS_LEVELS = (None, "token", "sequence")
LOSS_TYPES = ("ppo_clip", "reinforce")
# Rejection-sampling options: <level>_<estimator> over log r, r = pi_prox / pi_behav per token (as verl):
# k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r; token level, or the sum / mean / max over a
# sequence's valid tokens. A k1 option keeps exp(k1) in [lo, hi], i.e. the ratio pi_behav / pi_prox (its
# product or geometric mean for seq_sum / seq_mean); k2 and k3 options bound the estimate from above.
RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)

Bounds = tuple[float | None, float]  # (lower or None, upper)


class RolloutCorrectionConfigError(ValueError):
    """A rollout-correction setting has an invalid value."""


# ---------------------------------------------------------------------------------------------------
# Threshold parsing
# ---------------------------------------------------------------------------------------------------


def _number(entry: object, where: str) -> float:
    """Parse one threshold number (a python number or a numeric string); must be finite and > 0."""
    if isinstance(entry, bool):
        raise RolloutCorrectionConfigError(f"{where} must be a number; got {entry!r}")
    if isinstance(entry, (int, float)):
        value = float(entry)
    elif isinstance(entry, str) and entry.strip() and "_" not in entry:
        try:
            value = float(entry)
        except ValueError:
            raise RolloutCorrectionConfigError(f"{where} must be a number; got {entry!r}") from None
    else:
        raise RolloutCorrectionConfigError(f"{where} must be a number; got {entry!r}")
    if not (math.isfinite(value) and value > 0):
        raise RolloutCorrectionConfigError(f"{where} must be finite and > 0; got {entry!r}")
    return value


def _lo_hi(entry: str, where: str) -> Bounds:
    """Parse "lo_hi" into (lo, hi) with 0 < lo <= hi."""
    parts = entry.strip().split("_")
    if len(parts) != 2:
        raise RolloutCorrectionConfigError(f"{where} must be a number or 'lo_hi' (e.g. '0.5_2.0'); got {entry!r}")
    lo, hi = _number(parts[0], f"{where} (lower bound)"), _number(parts[1], f"{where} (upper bound)")
    if lo > hi:
        raise RolloutCorrectionConfigError(f"{where}: lower bound {lo} > upper bound {hi} in {entry!r}")
    return lo, hi


def _is_lo_hi(entry: object) -> bool:
    return isinstance(entry, str) and "_" in entry


def parse_is_threshold(spec: object) -> Bounds:
    """rollout_is_threshold -> (None, u) for truncation at u, or (lo, hi) for the band [lo, hi]."""
    where = f"{KEY_PREFIX}.rollout_is_threshold"
    if _is_lo_hi(spec):
        return _lo_hi(spec, where)
    return None, _number(spec, where)


def _split_options(options: str | Sequence[str]) -> tuple[str, ...]:
    """'token_k1,seq_max_k2' or ['token_k1', 'seq_max_k2'] -> the options in order; as verl, empty entries
    and repeats are dropped."""
    where = f"{KEY_PREFIX}.rollout_rs"
    if isinstance(options, str):
        names = [o.strip() for o in options.split(",")]
    elif isinstance(options, Sequence) and all(isinstance(o, str) for o in options):
        names = [o.strip() for o in options]
    else:
        raise RolloutCorrectionConfigError(
            f"{where} must be None or a comma-separated string of options; got {options!r}"
        )
    names = [n for n in names if n]
    valid = ", ".join(RS_OPTIONS)
    if not names or any(n not in RS_OPTIONS for n in names):
        raise RolloutCorrectionConfigError(f"{where} must be None or a comma-chain of {valid}; got {options!r}")
    return tuple(dict.fromkeys(names))


def _threshold_entries(spec: object) -> list[object]:
    """rollout_rs_threshold (a number or a comma-separated string) -> its non-empty entries, not yet parsed."""
    where = f"{KEY_PREFIX}.rollout_rs_threshold"
    if isinstance(spec, str):
        entries = [e.strip() for e in spec.split(",") if e.strip()]
        if not entries:
            raise RolloutCorrectionConfigError(f"{where} must be a number; got {spec!r}")
        return entries
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        return [spec]
    raise RolloutCorrectionConfigError(f"{where} must be a number or a string; got {spec!r}")


def check_rs_threshold_alone(spec: object) -> None:
    """Validate rollout_rs_threshold while rollout_rs is None: None, or entries that are each a number or "lo_hi".

    Without options the per-option rules (u >= 1 for k1, no "lo_hi" for k2/k3) cannot be applied; everything
    else is, so a bad value fails at construction rather than when rollout_rs is switched on.
    """
    if spec is None:
        return
    where = f"{KEY_PREFIX}.rollout_rs_threshold"
    for entry in _threshold_entries(spec):
        if _is_lo_hi(entry):
            _lo_hi(entry, where)
        else:
            _number(entry, where)


def parse_rollout_rs_thresholds(options: str | Sequence[str], spec: object) -> dict[str, Bounds]:
    """Map each rejection option to its (lower or None, upper) bounds, parsed from rollout_rs_threshold.

    spec is a number or a string; a comma-separated string gives one entry per option (in order, empty entries
    dropped), a single entry applies to every option. For *_k1 options an entry is "lo_hi" (bounds on the ratio
    pi_behav / pi_prox) or one number u meaning (1/u, u); for k2/k3 options it is one number, the upper bound, and the lower bound is None.
    Every number must be finite and > 0 and lo <= hi; anything else raises RolloutCorrectionConfigError
    (a ValueError) naming the option and the values.
    """
    names = _split_options(options)
    where = f"{KEY_PREFIX}.rollout_rs_threshold"
    if spec is None:
        raise RolloutCorrectionConfigError(f"{where} is required when rollout_rs is set (rollout_rs={options!r})")
    entries = _threshold_entries(spec)
    if len(entries) == 1:
        entries = entries * len(names)
    elif len(entries) != len(names):
        raise RolloutCorrectionConfigError(
            f"{where} has {len(entries)} entries ({spec!r}) but rollout_rs has {len(names)} options "
            f"({', '.join(names)}); give one entry per option or a single entry for all"
        )
    bounds: dict[str, Bounds] = {}
    for name, entry in zip(names, entries):
        here = f"{where} for {name!r}"
        if name.endswith("_k1"):
            if _is_lo_hi(entry):
                bounds[name] = _lo_hi(entry, here)
            else:
                u = _number(entry, here)
                if 1.0 / u > u:
                    raise RolloutCorrectionConfigError(
                        f"{here}: a single number u means bounds (1/u, u), so u must be >= 1; "
                        f"got u={entry!r}, i.e. lower bound {1.0 / u} > upper bound {u}"
                    )
                bounds[name] = (1.0 / u, u)
        else:
            if _is_lo_hi(entry):
                raise RolloutCorrectionConfigError(
                    f"{here} must be one number (an upper bound on the divergence); 'lo_hi' applies only "
                    f"to *_k1 options; got {entry!r}"
                )
            bounds[name] = (None, _number(entry, here))
    return bounds


# ---------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """Rollout correction settings (verl's algorithm.rollout_correction keys), validated at construction."""

    rollout_is: str | None = None
    """Importance weight pi_prox / pi_behav: None (no weights), "token" (per-token r = exp(clamp(log r, +-20))) or
    "sequence" (exp of the sequence's summed log r, the sum clamped to +-20), as verl."""

    rollout_is_threshold: float | str = 2.0
    """A number u: truncate the weight at u (TIS); or "lo_hi": keep weights in [lo, hi] and zero the rest (IcePop;
    the zeroed tokens stay in the loss mask and its denominators, as in verl)."""

    rollout_is_batch_normalize: bool = False
    """Divide the IS weights by their mean over the batch (token: over valid tokens; sequence: over non-empty
    sequences), so they average 1; nothing happens when that mean is <= 1e-8 (verl's rule)."""

    rollout_rs: str | None = None
    """Rejection sampling: None or a comma-chain of RS_OPTIONS; a token is kept only if every option passes, and
    a rejected token leaves the loss mask (every loss term and every denominator)."""

    rollout_rs_threshold: float | str | None = None
    """Bounds for rollout_rs, see parse_rollout_rs_thresholds; required when rollout_rs is set, else None or a
    number or string whose entries parse (check_rs_threshold_alone)."""

    bypass_mode: bool = False
    """No proximal recompute: pi_prox := pi_behav and the loss is bypass_policy_loss (weights and rejection are then
    computed on pi_theta / pi_behav, as in verl)."""

    loss_type: str = "ppo_clip"
    """Bypass-mode loss: "ppo_clip" (PPO ratio pi_theta / pi_behav) or "reinforce" (IS-weighted REINFORCE)."""

    is_bounds: Bounds = field(init=False, compare=False, repr=False)
    """Parsed rollout_is_threshold: (None, u) for truncation or (lo, hi) for a band."""

    rs_bounds: Mapping[str, Bounds] = field(init=False, compare=False, repr=False)
    """Parsed rollout_rs thresholds: option -> (lower or None, upper); empty when rollout_rs is None."""

    def __post_init__(self) -> None:
        if self.rollout_is not in IS_LEVELS:
            raise RolloutCorrectionConfigError(
                f"{KEY_PREFIX}.rollout_is must be one of None, 'token', 'sequence'; got {self.rollout_is!r}"
            )
        if not isinstance(self.rollout_is_batch_normalize, bool):
            raise RolloutCorrectionConfigError(
                f"{KEY_PREFIX}.rollout_is_batch_normalize must be a bool; got {self.rollout_is_batch_normalize!r}"
            )
        if not isinstance(self.bypass_mode, bool):
            raise RolloutCorrectionConfigError(f"{KEY_PREFIX}.bypass_mode must be a bool; got {self.bypass_mode!r}")
        if self.loss_type not in LOSS_TYPES:
            raise RolloutCorrectionConfigError(
                f"{KEY_PREFIX}.loss_type must be one of 'ppo_clip', 'reinforce'; got {self.loss_type!r}"
            )
        if self.loss_type != "ppo_clip" and not self.bypass_mode:
            raise RolloutCorrectionConfigError(
                f"{KEY_PREFIX}.loss_type={self.loss_type!r} applies only in bypass mode; set bypass_mode=True "
                "or loss_type='ppo_clip'"
            )
        object.__setattr__(self, "is_bounds", parse_is_threshold(self.rollout_is_threshold))
        rs_bounds: dict[str, Bounds] = {}
        if self.rollout_rs is not None:
            rs_bounds = parse_rollout_rs_thresholds(self.rollout_rs, self.rollout_rs_threshold)
            object.__setattr__(self, "rollout_rs", ",".join(rs_bounds))  # canonical "a,b" form
        else:
            check_rs_threshold_alone(self.rollout_rs_threshold)  # also keeps the config hashable
        object.__setattr__(self, "rs_bounds", MappingProxyType(rs_bounds))

    @classmethod
    def from_dict(cls, values: Mapping[str, object]) -> RolloutCorrectionConfig:
        """Build from a plain mapping (e.g. an OmegaConf section); unknown keys raise, listing the valid ones."""
        valid = [f.name for f in fields(cls) if f.init]
        unknown = sorted(set(values) - set(valid))
        if unknown:
            raise RolloutCorrectionConfigError(
                f"unknown key(s) {unknown} in {KEY_PREFIX}; valid keys: {', '.join(valid)}"
            )
        return cls(**{k: values[k] for k in values})
