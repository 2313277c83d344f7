"""Rollout correction for decoupled PPO: the importance weight pi_prox / pi_behav and rejection sampling.

The behavior policy pi_behav generated the rollout (its log-probs, rollout_log_prob, come with the sample);
the proximal policy pi_prox (old_log_prob) is recomputed by the trainer at the start of the sync cycle.
Per token, r = pi_prox / pi_behav with log r clamped to [-20, 20]. The weight multiplies the per-token PPO
loss: w = r (token) or prod r over the sequence (sequence), truncated at u or zeroed outside [lo, hi], and
zeroed wherever rejection sampling rejects the token or its sequence. Key names follow verl's
algorithm.rollout_correction section.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType

import torch

from dppo.algo._common import (
    Checks,
    as_mask,
    check_2d,
    check_same_shape,
    check_tensor,
    masked_log_ratio,
    masked_max,
    masked_mean,
    masked_min,
    to_floats,
)

KEY_PREFIX = "algorithm.rollout_correction"
IS_LEVELS = (None, "token", "sequence")
LOSS_TYPES = ("ppo_clip", "reinforce")
# Rejection-sampling options: <level>_<estimator>. k1 bounds the ratio to [lo, hi]; k2 and k3 bound the
# divergence estimate from above.
RS_OPTIONS = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)  # fmt: skip

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
    """'token_k1,seq_max_k2' or ['token_k1', 'seq_max_k2'] -> validated, duplicate-free tuple."""
    where = f"{KEY_PREFIX}.rollout_rs"
    if isinstance(options, str):
        names = tuple(o.strip() for o in options.split(","))
    elif isinstance(options, Sequence) and all(isinstance(o, str) for o in options):
        names = tuple(o.strip() for o in options)
    else:
        raise RolloutCorrectionConfigError(
            f"{where} must be None or a comma-separated string of options; got {options!r}"
        )
    valid = ", ".join(RS_OPTIONS)
    if not names or any(n not in RS_OPTIONS for n in names):
        raise RolloutCorrectionConfigError(f"{where} must be None or a comma-chain of {valid}; got {options!r}")
    if len(set(names)) != len(names):
        raise RolloutCorrectionConfigError(f"{where} lists an option twice: {options!r}")
    return names


def _threshold_entries(spec: object) -> list[object]:
    """rollout_rs_threshold (a number or a comma-separated string) -> its entries, not yet parsed."""
    if isinstance(spec, str):
        return [e.strip() for e in spec.split(",")]
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        return [spec]
    raise RolloutCorrectionConfigError(f"{KEY_PREFIX}.rollout_rs_threshold must be a number or a string; got {spec!r}")


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

    spec is a number or a string; a comma-separated string gives one entry per option (in order), a single
    entry applies to every option. For *_k1 options an entry is "lo_hi" (bounds on the ratio) or one number
    u meaning (1/u, u); for k2/k3 options it is one number, the upper bound, and the lower bound is None.
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
    """Importance weight pi_prox / pi_behav: None (weight 1), "token" (per-token r) or "sequence" (prod r)."""

    rollout_is_threshold: float | str = 2.0
    """A number u: truncate the weight at u; or "lo_hi": keep weights in [lo, hi] and zero the rest."""

    rollout_rs: str | None = None
    """Rejection sampling: None or a comma-chain of RS_OPTIONS; a token is kept only if every option passes."""

    rollout_rs_threshold: float | str | None = None
    """Bounds for rollout_rs, see parse_rollout_rs_thresholds; required when rollout_rs is set, else None or a
    number or string whose entries parse (check_rs_threshold_alone)."""

    bypass_mode: bool = False
    """No proximal recompute: pi_prox := pi_behav and the loss is bypass_policy_loss."""

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


# ---------------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------------

# How a per-token statistic (B, T) is reduced over a sequence's valid tokens, per rejection level.
_SEQ_REDUCERS = {
    "seq_sum": lambda v, mask: v.sum(-1, keepdim=True),
    "seq_mean": lambda v, mask: v.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1),
    "seq_max": lambda v, mask: v.amax(-1, keepdim=True),  # v >= 0 (k2, k3) and 0 at masked positions
}


def _token_stats(log_r: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token estimators, 0 at masked positions: k1 is log r (tested against log bounds), k2, k3."""
    return {
        "k1": log_r,
        "k2": 0.5 * log_r.square(),
        "k3": torch.where(mask, torch.exp(log_r) - 1.0 - log_r, 0.0),
    }


def rejection_mask(log_r: torch.Tensor, mask: torch.Tensor, rs_bounds: Mapping[str, Bounds]) -> torch.Tensor:
    """Tokens (B, T) that pass every rejection option; log_r (B, T) must be 0 at masked positions."""
    keep = mask.clone()
    if not rs_bounds:
        return keep
    stats = _token_stats(log_r, mask)
    for name, (lo, hi) in rs_bounds.items():
        level, kind = name.rsplit("_", 1)  # e.g. "seq_mean", "k3"
        value = stats[kind]  # (B, T)
        if level != "token":
            value = _SEQ_REDUCERS[level](value, mask)  # (B, 1)
        if kind == "k1":  # exp(value) in [lo, hi], compared in log space so no exp overflows
            passed = (value >= math.log(lo)) & (value <= math.log(hi))
        else:
            passed = value <= hi
        keep &= passed
    return keep


def _is_weights(log_r: torch.Tensor, mask: torch.Tensor, config: RolloutCorrectionConfig):
    """IS weights (B, T) before rejection, tokens kept by the band (B, T), and truncated tokens (B, T)."""
    if config.rollout_is is None:
        return torch.ones_like(log_r), mask, torch.zeros_like(mask)
    log_w = log_r if config.rollout_is == "token" else log_r.sum(-1, keepdim=True).expand_as(log_r)  # (B, T)
    lo, hi = config.is_bounds
    log_hi = math.log(hi)
    w = torch.exp(log_w.clamp(max=log_hi))  # min(w, hi); the clamp also keeps prod r finite
    if lo is None:
        return w, mask, mask & (log_w > log_hi)
    in_band = mask & (log_w >= math.log(lo)) & (log_w <= log_hi)
    return w, in_band, torch.zeros_like(mask)


def rollout_correction_tensors(old_log_prob, rollout_log_prob, mask, config):
    """compute_rollout_correction without checks or host sync: weights (B, T) and 0-dim metric tensors."""
    log_r = masked_log_ratio(old_log_prob.detach(), rollout_log_prob, mask)  # (B, T), log pi_prox / pi_behav
    w, in_band, truncated = _is_weights(log_r, mask, config)
    keep = rejection_mask(log_r, mask, config.rs_bounds) & in_band  # (B, T)
    weights = torch.where(keep, w, 0.0)  # (B, T)

    has_tokens = mask.any(-1)  # (B,)
    rejected = mask & ~keep
    k3 = torch.where(mask, torch.exp(log_r) - 1.0 - log_r, 0.0)
    sum_w, sum_w2, n = weights.sum(), weights.square().sum(), mask.sum()
    metrics = {
        "rollout_corr/weight_mean": masked_mean(weights, mask),
        "rollout_corr/weight_max": masked_max(weights, mask),
        "rollout_corr/weight_min": masked_min(weights, mask),
        "rollout_corr/weight_truncated_frac": masked_mean((truncated & keep).float(), mask),
        "rollout_corr/token_rejected_frac": masked_mean(rejected.float(), mask),
        "rollout_corr/seq_rejected_frac": masked_mean((has_tokens & ~keep.any(-1)).float(), has_tokens),
        "rollout_corr/kl_k1": masked_mean(-log_r, mask),
        "rollout_corr/kl_k3": masked_mean(k3, mask),
        "rollout_corr/ess": torch.where(sum_w2 > 0, sum_w.square() / (n * sum_w2), 0.0),
    }
    return weights, metrics


def compute_rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    config: RolloutCorrectionConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Rollout-correction weights (B, T) fp32, detached, 0 where response_mask is 0, and their metrics.

    old_log_prob is log pi_prox, rollout_log_prob is log pi_behav, both (B, T). The weight is the IS weight
    (1 if config.rollout_is is None; token: r; sequence: exp(sum of log r over valid tokens), broadcast),
    truncated at u or zeroed outside [lo, hi] per rollout_is_threshold, times the rejection mask.
    Metrics (python floats; means over valid tokens unless noted):
      rollout_corr/weight_mean, rollout_corr/weight_max, rollout_corr/weight_min: of the final weights;
      rollout_corr/weight_truncated_frac: kept tokens whose IS weight was truncated at u;
      rollout_corr/token_rejected_frac: tokens given weight 0 (rejection sampling or outside the IS band);
      rollout_corr/seq_rejected_frac: sequences with valid tokens of which none is kept;
      rollout_corr/kl_k1: mean of -log r (k1 estimate of KL(pi_behav || pi_prox));
      rollout_corr/kl_k3: mean of r - 1 - log r (k3 estimate);
      rollout_corr/ess: (sum w)^2 / (n * sum w^2), the normalized effective sample size of the weights.
    Raises AlgoInputError unless the mask is (B, T), ShapeMismatchError on shape mismatch and
    NonFiniteError for NaN/inf at a valid position (all ValueErrors).
    """
    mask = as_mask("response_mask", response_mask)
    check_2d("response_mask", mask)
    check_tensor("old_log_prob", old_log_prob)
    check_same_shape("response_mask", mask, old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob)
    if not isinstance(config, RolloutCorrectionConfig):
        raise TypeError(f"config must be a RolloutCorrectionConfig; got {type(config).__name__}")
    checks = Checks(mask)
    checks.finite("old_log_prob", old_log_prob)
    checks.finite("rollout_log_prob", rollout_log_prob)
    with torch.no_grad():
        weights, metrics = rollout_correction_tensors(old_log_prob, rollout_log_prob, mask, config)
    return weights, to_floats(metrics, checks)
