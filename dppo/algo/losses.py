"""Decoupled PPO policy losses, their bypass-mode variants, loss aggregation and the entropy bonus.

    L = - E[ w * min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A) ],  r = pi_theta / pi_prox,  w = pi_prox / pi_behav

with dual clip (for A < 0 the per-token loss is capped at -c * A). w comes from compute_rollout_correction
and carries no gradient. In bypass mode pi_prox := pi_behav and the variant is chosen by name from
POLICY_LOSSES (config.loss_type).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from dppo.algo._common import (
    AlgoInputError,
    Checks,
    as_mask,
    check_2d,
    check_same_shape,
    check_tensor,
    lookup,
    masked_log_ratio,
    masked_max,
    masked_mean,
    masked_min,
    to_floats,
)
from dppo.algo.rollout_correction import RolloutCorrectionConfig, rollout_correction_tensors

# ---------------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------------


def _token_mean(loss_mat, mask):
    """Sum over valid tokens / number of valid tokens (DAPO)."""
    return loss_mat.sum() / mask.sum().clamp(min=1)


def _seq_mean_token_sum(loss_mat, mask):
    """Mean over non-empty sequences of each sequence's token sum."""
    return loss_mat.sum() / mask.any(-1).sum().clamp(min=1)


def _seq_mean_token_mean(loss_mat, mask):
    """Mean over non-empty sequences of each sequence's token mean (original GRPO)."""
    seq_losses = loss_mat.sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)
    return seq_losses.sum() / mask.any(-1).sum().clamp(min=1)


def _seq_mean_token_sum_norm(loss_mat, mask):
    """Sum over all valid tokens / T, the padded length (Dr. GRPO's constant normalizer, as in verl)."""
    return loss_mat.sum() / loss_mat.shape[-1]


LOSS_AGG_MODES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def agg_loss_unchecked(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """agg_loss without input checks; loss_mat may hold anything at masked positions."""
    reduce = lookup(LOSS_AGG_MODES, mode, "loss_agg_mode")
    return reduce(torch.where(mask, loss_mat, 0.0), mask)


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean") -> torch.Tensor:
    """Aggregate a per-token loss (B, T) over valid tokens into a 0-dim fp32 tensor, by verl's loss_agg_mode.

    token-mean: sum / number of valid tokens; seq-mean-token-sum: mean over sequences of the token sum;
    seq-mean-token-mean: mean over sequences of the token mean; seq-mean-token-sum-norm: sum / T.
    Sequences without valid tokens are left out of the seq-mean averages; no valid token at all gives 0.
    """
    loss_mat = check_tensor("loss_mat", loss_mat)
    mask = as_mask("mask", mask)
    check_same_shape("mask", mask, loss_mat=loss_mat)
    check_2d("loss_mat", loss_mat)
    checks = Checks(mask, "mask")
    checks.finite("loss_mat", loss_mat)
    loss = agg_loss_unchecked(loss_mat.float(), mask, mode)
    to_floats({}, checks)
    return loss


# ---------------------------------------------------------------------------------------------------
# Decoupled PPO
# ---------------------------------------------------------------------------------------------------


def _check_clip(clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float) -> None:
    """Validate the clip range [1 - low, 1 + high] and the dual-clip constant c."""
    for name, value in (("clip_ratio_low", clip_ratio_low), ("clip_ratio_high", clip_ratio_high),
                        ("clip_ratio_c", clip_ratio_c)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise AlgoInputError(f"{name} must be a finite number; got {value!r}")
    if not 0 <= clip_ratio_low < 1:
        raise AlgoInputError(f"clip_ratio_low must be in [0, 1) so that 1 - clip_ratio_low > 0; got {clip_ratio_low}")
    if clip_ratio_high < 0:
        raise AlgoInputError(f"clip_ratio_high must be >= 0; got {clip_ratio_high}")
    if clip_ratio_c <= 1:
        raise AlgoInputError(f"clip_ratio_c (dual clip) must be > 1; got {clip_ratio_c}")


def _check_loss_inputs(log_prob, old_name, old_log_prob, advantages, response_mask, weights=None):
    """Shape and type checks shared by the policy losses; returns the bool mask (B, T) and Checks."""
    mask = as_mask("response_mask", response_mask)
    check_2d("response_mask", mask)
    check_tensor("log_prob", log_prob)
    check_same_shape(
        "response_mask", mask, log_prob=log_prob, **{old_name: old_log_prob}, advantages=advantages, weights=weights
    )
    checks = Checks(mask)
    checks.finite("log_prob", log_prob)
    checks.finite(old_name, old_log_prob)
    checks.finite("advantages", advantages)
    if weights is not None:
        checks.finite("weights", weights)
        checks.nonnegative("weights", weights)
    return mask, checks


def _ratio_metrics(log_ratio: torch.Tensor, ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """ppo_kl (mean of old - new log-prob) and ratio mean/max/min over valid tokens."""
    return {
        "actor/ppo_kl": masked_mean(torch.where(mask, -log_ratio, 0.0), mask),
        "actor/ratio_mean": masked_mean(torch.where(mask, ratio, 0.0), mask),
        "actor/ratio_max": masked_max(ratio, mask),
        "actor/ratio_min": masked_min(ratio, mask),
    }


def _ppo_clip_terms(log_prob, old_log_prob, advantages, mask, weights, low, high, c, mode):
    """Loss (0-dim) and metric tensors of the clipped objective; inputs are already checked."""
    adv = torch.where(mask, advantages.detach().float(), 0.0)  # (B, T)
    log_ratio = masked_log_ratio(log_prob, old_log_prob, mask)  # (B, T), differentiable in log_prob
    ratio = torch.exp(log_ratio)  # (B, T), pi_theta / pi_prox

    # Each clip is a branch chosen by a strict comparison, so that on a tie (e.g. r exactly on a clip
    # bound) the unclipped term and its full gradient win; torch.maximum would split the gradient.
    pg_losses1 = -adv * ratio
    pg_losses2 = -adv * ratio.clamp(1.0 - low, 1.0 + high)
    clipped = mask & (pg_losses2 > pg_losses1)  # (B, T)
    clip_pg_losses1 = torch.where(clipped, pg_losses2, pg_losses1)  # standard PPO clip: the max of the two
    pg_losses3 = -adv * c
    clipped_lower = mask & (adv < 0) & (clip_pg_losses1 > pg_losses3)  # (B, T)
    pg_losses = torch.where(clipped_lower, pg_losses3, clip_pg_losses1)  # dual clip: cap at -c * A for A < 0
    if weights is not None:
        pg_losses = pg_losses * torch.where(mask, weights.detach().float(), 0.0)
    # Denominators use response_mask, not the rejection mask: rejecting a token must not enlarge the
    # gradient of the tokens that are kept.
    pg_loss = agg_loss_unchecked(pg_losses, mask, mode)

    with torch.no_grad():
        metrics = {
            "actor/pg_loss": pg_loss.detach(),
            "actor/pg_clipfrac": masked_mean(clipped.float(), mask),
            "actor/pg_clipfrac_lower": masked_mean(clipped_lower.float(), mask),
            **_ratio_metrics(log_ratio, ratio, mask),
        }
    return pg_loss, metrics


def policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    weights: torch.Tensor | None = None,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO loss (0-dim fp32, differentiable in log_prob) and its metrics.

    log_prob is log pi_theta, old_log_prob is log pi_prox, advantages A; all (B, T). Per token:
    r = exp(clamp(log_prob - old_log_prob, -20, 20)); loss = max(-A r, -A clip(r, 1 - low, 1 + high)),
    capped at -c A where A < 0 (dual clip); times weights (the detached rollout-correction weight) if
    given; aggregated by loss_agg_mode over response_mask (token-mean divides by the count of
    response_mask, so a rejected token, weight 0, still counts in the denominator).
    Metrics (python floats, over valid tokens):
      actor/pg_loss: the loss;  actor/pg_clipfrac: fraction with -A clip(r) > -A r (clip active);
      actor/pg_clipfrac_lower: fraction with A < 0 and the dual-clip cap active;
      actor/ppo_kl: mean of old_log_prob - log_prob;  actor/ratio_mean, actor/ratio_max, actor/ratio_min.
    """
    mask, checks = _check_loss_inputs(log_prob, "old_log_prob", old_log_prob, advantages, response_mask, weights)
    _check_clip(clip_ratio_low, clip_ratio_high, clip_ratio_c)
    loss, metrics = _ppo_clip_terms(
        log_prob, old_log_prob, advantages, mask, weights,
        clip_ratio_low, clip_ratio_high, clip_ratio_c, loss_agg_mode,
    )  # fmt: skip
    return loss, to_floats(metrics, checks)


# ---------------------------------------------------------------------------------------------------
# Bypass mode (pi_prox := pi_behav): the POLICY_LOSSES registry
# ---------------------------------------------------------------------------------------------------


def ppo_clip_bypass_loss(
    log_prob, rollout_log_prob, advantages, response_mask, config, *,
    clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode="token-mean",
):  # fmt: skip
    """Bypass "ppo_clip": policy_loss with old := rollout (r = pi_theta / pi_behav) and no extra weights."""
    return policy_loss(
        log_prob, rollout_log_prob, advantages, response_mask,
        clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c,
        loss_agg_mode=loss_agg_mode,
    )  # fmt: skip


def reinforce_bypass_loss(
    log_prob, rollout_log_prob, advantages, response_mask, config, *,
    clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode="token-mean",
):  # fmt: skip
    """Bypass "reinforce": -A * log pi_theta * w, w = pi_theta / pi_behav detached, truncated/rejected per config.

    w is compute_rollout_correction(log_prob.detach(), rollout_log_prob, ...) under config, so its
    rollout_corr/* metrics are returned too. REINFORCE has no ratio to clip: the clip arguments are
    validated and otherwise unused (they exist so every POLICY_LOSSES entry takes the same arguments);
    actor/pg_clipfrac and actor/pg_clipfrac_lower are reported as 0.
    """
    mask, checks = _check_loss_inputs(log_prob, "rollout_log_prob", rollout_log_prob, advantages, response_mask)
    _check_clip(clip_ratio_low, clip_ratio_high, clip_ratio_c)
    with torch.no_grad():
        # (B, T): w = pi_theta / pi_behav, truncated and rejected as configured
        weights, rc_metrics = rollout_correction_tensors(log_prob, rollout_log_prob, mask, config)
    logp = torch.where(mask, log_prob.float(), 0.0)  # (B, T), differentiable
    adv = torch.where(mask, advantages.detach().float(), 0.0)
    pg_loss = agg_loss_unchecked(-adv * logp * weights, mask, loss_agg_mode)
    with torch.no_grad():
        log_ratio = masked_log_ratio(log_prob.detach(), rollout_log_prob, mask)  # (B, T), log pi_theta / pi_behav
        zero = pg_loss.new_zeros(())
        metrics = {
            "actor/pg_loss": pg_loss.detach(),
            "actor/pg_clipfrac": zero,
            "actor/pg_clipfrac_lower": zero,
            **_ratio_metrics(log_ratio, torch.exp(log_ratio), mask),
            **rc_metrics,
        }
    return pg_loss, to_floats(metrics, checks)


POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, float]]]] = {
    "ppo_clip": ppo_clip_bypass_loss,
    "reinforce": reinforce_bypass_loss,
}


def get_policy_loss(name: str) -> Callable[..., tuple[torch.Tensor, dict[str, float]]]:
    """Return the bypass-mode policy loss registered under name ('ppo_clip', 'reinforce')."""
    return lookup(POLICY_LOSSES, name, "policy loss")


def bypass_policy_loss(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: RolloutCorrectionConfig,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy loss without the proximal recompute (pi_prox := pi_behav), the variant named by config.loss_type.

    "ppo_clip" is policy_loss(log_prob, rollout_log_prob, ...) with no weights (same metric keys);
    "reinforce" is reinforce_bypass_loss (adds the rollout_corr/* keys). config.bypass_mode must be True.
    """
    if not isinstance(config, RolloutCorrectionConfig):
        raise TypeError(f"config must be a RolloutCorrectionConfig; got {type(config).__name__}")
    if not config.bypass_mode:
        raise AlgoInputError(
            "bypass_policy_loss needs algorithm.rollout_correction.bypass_mode=True; with bypass_mode=False "
            "recompute old_log_prob and use compute_rollout_correction + policy_loss"
        )
    return get_policy_loss(config.loss_type)(
        log_prob, rollout_log_prob, advantages, response_mask, config,
        clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c,
        loss_agg_mode=loss_agg_mode,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Entropy bonus
# ---------------------------------------------------------------------------------------------------


def entropy_bonus(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss term -coef * agg(entropy) (add it to the policy loss to reward entropy) and {"actor/entropy": agg}."""
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not math.isfinite(coef):
        raise AlgoInputError(f"coef must be a finite number; got {coef!r}")
    mask = as_mask("response_mask", response_mask)
    check_2d("response_mask", mask)
    check_same_shape("response_mask", mask, entropy=entropy)
    checks = Checks(mask)
    checks.finite("entropy", entropy)
    mean_entropy = agg_loss_unchecked(entropy.float(), mask, loss_agg_mode)
    return -coef * mean_entropy, to_floats({"actor/entropy": mean_entropy}, checks)
