"""Rollout correction for decoupled PPO: importance weights pi_prox / pi_behav and the rejection mask.

The behavior policy pi_behav generated the rollout (its log-probs, rollout_log_prob, come with the sample);
the proximal policy pi_prox (old_log_prob) is recomputed by the trainer. Per token log r = old_log_prob -
rollout_log_prob. The importance weight multiplies the per-token PPO loss; rejection sampling removes tokens
from the loss mask. The two are independent, as in verl 0.9.1's compute_rollout_correction_and_rejection_mask,
and every comparison below is written as verl writes it, so masks agree with verl's bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from dppo.algo._common import (
    LOG_RATIO_BOUND,
    check_masked_terms,
    masked_max,
    masked_mean,
    masked_min,
    to_floats,
)
from dppo.rollout_correction_config import Bounds, RolloutCorrectionConfig

# ---------------------------------------------------------------------------------------------------
# Rejection mask
# ---------------------------------------------------------------------------------------------------


def _seq_sum(v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, v, 0.0).sum(-1)  # (B,)


def _seq_mean(v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _seq_sum(v, mask) / (mask.sum(-1) + 1e-8)  # (B,), verl's masked_mean


def _seq_max(v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = v.masked_fill(~mask, float("-inf")).amax(-1) if v.shape[-1] else v.new_zeros(v.shape[:-1])
    return torch.where(m == float("-inf"), 0.0, m)  # (B,), 0 for a sequence without valid tokens


_SEQ_REDUCERS = {"seq_sum": _seq_sum, "seq_mean": _seq_mean, "seq_max": _seq_max}


def rejection_mask(log_r: torch.Tensor, mask: torch.Tensor, rs_bounds: Mapping[str, Bounds]) -> torch.Tensor:
    """The loss mask (B, T) after rejection: the tokens of mask that pass every option of rs_bounds.

    log_r (B, T) must be finite at valid positions. Per token the estimators are taken of clamp(log r, +-20):
    k1 = -log r, k2 = (log r)^2 / 2, k3 = exp(log r) - 1 - log r. A k1 statistic s passes when
    log(lo) <= s <= log(hi); a k2/k3 statistic when s <= hi. Sequence options reduce over valid tokens.
    """
    keep = mask.clone()
    if not rs_bounds:
        return keep
    safe = log_r.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    stats = {"k1": -safe, "k2": 0.5 * safe**2, "k3": torch.exp(safe) - 1.0 - safe}  # (B, T) each
    for name, (lo, hi) in rs_bounds.items():
        level, kind = name.rsplit("_", 1)  # e.g. "seq_mean", "k3"
        value = stats[kind]  # (B, T)
        if level != "token":
            value = _SEQ_REDUCERS[level](value, mask)[:, None]  # (B, 1)
        if kind == "k1":
            passed = (value >= math.log(lo)) & (value <= math.log(hi))
        else:
            passed = value <= hi
        keep &= passed
    return keep


# ---------------------------------------------------------------------------------------------------
# Importance weights
# ---------------------------------------------------------------------------------------------------


def _batch_mean(w: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Mean weight over the batch (0-dim): over valid tokens (token) or over non-empty sequences (sequence)."""
    if level == "token":
        return torch.where(mask, w, 0.0).sum() / (mask.sum() + 1e-8)
    seq_w = _seq_mean(w, mask)  # (B,)
    seq_mask = (mask.sum(-1) > 0).float()
    return (seq_w * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)


def importance_weights(log_r: torch.Tensor, mask: torch.Tensor, config: RolloutCorrectionConfig):
    """IS weights (B, T), 0 at masked positions, with the tokens truncated at u and those zeroed by the band.

    token: r = exp(clamp(log r, +-20)); sequence: exp(clamp(sum of log r over valid tokens, +-20)), broadcast.
    Threshold u: min(r, u); "lo_hi": r where lo <= r <= hi, else 0. With rollout_is_batch_normalize the
    weights are divided by their batch mean when it exceeds 1e-8. Returns (weights, truncated, zeroed,
    batch mean or None).
    """
    if config.rollout_is == "token":
        log_w = log_r.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # (B, T)
    else:
        log_w = _seq_sum(log_r, mask)[:, None].clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).expand_as(log_r)
    raw = torch.where(mask, torch.exp(log_w), 0.0)  # (B, T)
    lo, hi = config.is_bounds
    if lo is None:
        weights, truncated, zeroed = raw.clamp(max=hi), mask & (raw > hi), torch.zeros_like(mask)
    else:
        in_band = (raw >= lo) & (raw <= hi)
        weights, truncated, zeroed = torch.where(in_band, raw, 0.0), torch.zeros_like(mask), mask & ~in_band
    batch_mean = None
    if config.rollout_is_batch_normalize:
        batch_mean = _batch_mean(weights, mask, config.rollout_is)
        weights = torch.where(batch_mean > 1e-8, weights / batch_mean, weights)
    return weights, truncated, zeroed, batch_mean


# ---------------------------------------------------------------------------------------------------
# Both, with metrics
# ---------------------------------------------------------------------------------------------------


def _metrics(log_r, mask, keep, weights, truncated, zeroed, batch_mean) -> dict[str, torch.Tensor]:
    """0-dim metric tensors; weights (B, T) are the applied weights (all 1 without IS)."""
    safe = torch.where(mask, log_r.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND), 0.0)
    k3 = torch.where(mask, torch.exp(safe) - 1.0 - safe, 0.0)
    has_tokens = mask.any(-1)  # (B,)
    sum_w, sum_w2, n = weights.sum(), weights.square().sum(), mask.sum()
    metrics = {
        "rollout_corr/weight_mean": masked_mean(weights, mask),
        "rollout_corr/weight_max": masked_max(weights, mask),
        "rollout_corr/weight_min": masked_min(weights, mask),
        "rollout_corr/weight_truncated_frac": masked_mean(truncated.float(), mask),
        "rollout_corr/weight_zeroed_frac": masked_mean(zeroed.float(), mask),
        "rollout_corr/token_rejected_frac": masked_mean((mask & ~keep).float(), mask),
        "rollout_corr/seq_rejected_frac": masked_mean((has_tokens & ~keep.any(-1)).float(), has_tokens),
        "rollout_corr/kl_k1": masked_mean(-safe, mask),
        "rollout_corr/kl_k3": masked_mean(k3, mask),
        "rollout_corr/ess": torch.where(sum_w2 > 0, sum_w.square() / (n * sum_w2), 0.0),
    }
    if batch_mean is not None:
        metrics["rollout_corr/weight_batch_mean"] = batch_mean
    return metrics


def rollout_correction_tensors(old_log_prob, rollout_log_prob, mask, config):
    """compute_rollout_correction_and_rejection_mask without checks or host sync: metrics stay 0-dim tensors."""
    old, rollout = old_log_prob.detach().float(), rollout_log_prob.detach().float()
    log_r = torch.where(mask, old, 0.0) - torch.where(mask, rollout, 0.0)  # (B, T), log pi_prox / pi_behav
    keep = rejection_mask(log_r, mask, config.rs_bounds)  # (B, T)
    weights = None
    applied, truncated, zeroed, batch_mean = mask.float(), torch.zeros_like(mask), torch.zeros_like(mask), None
    if config.rollout_is is not None:
        weights, truncated, zeroed, batch_mean = importance_weights(log_r, mask, config)
        applied = weights
    return weights, keep, _metrics(log_r, mask, keep, applied, truncated, zeroed, batch_mean)


def compute_rollout_correction_and_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    config: RolloutCorrectionConfig,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """IS weights and the rejection-modified response mask, as verl's function of the same name, and metrics.

    old_log_prob is log pi_prox, rollout_log_prob is log pi_behav, both (B, T). Returns
      weights: (B, T) fp32, detached, 0 where response_mask is 0 (importance_weights), or None when
        config.rollout_is is None;
      modified_response_mask: (B, T) bool, response_mask without the tokens rollout_rs rejects
        (rejection_mask); the loss uses it for every term and every denominator;
      metrics (python floats; means over the valid tokens of response_mask unless noted):
        rollout_corr/weight_mean, _max, _min: of the weights (1 without IS), after batch normalization;
        rollout_corr/weight_truncated_frac: tokens whose weight was truncated at u;
        rollout_corr/weight_zeroed_frac: tokens whose weight the band [lo, hi] set to 0;
        rollout_corr/token_rejected_frac: tokens rollout_rs removed from the mask;
        rollout_corr/seq_rejected_frac: of the sequences with valid tokens, those rollout_rs removed whole;
        rollout_corr/kl_k1: mean of -log r (k1 estimate of KL(pi_behav || pi_prox)), log r clamped to +-20;
        rollout_corr/kl_k3: mean of r - 1 - log r (k3 estimate);
        rollout_corr/ess: (sum w)^2 / (n * sum w^2), the normalized effective sample size of the weights;
        rollout_corr/weight_batch_mean: the mean the weights were divided by (only with batch normalization).
    Whatever masked positions hold (NaN included) changes nothing. Raises AlgoInputError unless the mask is
    (B, T), ShapeMismatchError on shape mismatch and NonFiniteError for NaN/inf at a valid position (all
    ValueErrors).
    """
    mask, checks = check_masked_terms(
        "response_mask", response_mask, old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob
    )
    if not isinstance(config, RolloutCorrectionConfig):
        raise TypeError(f"config must be a RolloutCorrectionConfig; got {type(config).__name__}")
    with torch.no_grad():
        weights, keep, metrics = rollout_correction_tensors(old_log_prob, rollout_log_prob, mask, config)
    return weights, keep, to_floats(metrics, checks)
