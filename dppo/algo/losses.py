"""Decoupled PPO policy losses, their bypass-mode variants, loss aggregation and the entropy bonus.

    L = - E[ w * min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A) ],  r = pi_theta / pi_prox,  w = pi_prox / pi_behav

with dual clip (for A < 0 the per-token loss is capped at -c * A), aggregated over the loss mask (the response
mask after rejection sampling) by dppo.algo.aggregation. w comes from compute_rollout_correction_and_rejection_mask
and carries no gradient. In bypass mode pi_prox := pi_behav, the correction is computed on pi_theta / pi_behav,
and the variant is chosen by name from POLICY_LOSSES (config.loss_type), as verl's compute_policy_loss_bypass_mode.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dppo.algo._common import (
    AlgoInputError,
    LossNormalizers,
    check_added_term,
    check_loss_scale_factor,
    check_masked_terms,
    check_number,
    check_tensor,
    lookup,
    masked_log_ratio,
    masked_max,
    masked_mean,
    masked_min,
    to_floats,
    unclamped_log_ratio,
)
from dppo.algo.aggregation import agg_loss_unchecked
from dppo.algo.rollout_correction import (
    RolloutCorrectionConfig,
    rollout_correction_tensors,
)

# ---------------------------------------------------------------------------------------------------
# Decoupled PPO
# ---------------------------------------------------------------------------------------------------


def clip_range(clip_ratio: float, clip_ratio_low: float | None, clip_ratio_high: float | None) -> tuple[float, float]:
    """(low, high) as verl reads them: clip_ratio_low and clip_ratio_high where set, clip_ratio where they are None."""
    check_number("clip_ratio", clip_ratio)
    return (
        clip_ratio if clip_ratio_low is None else clip_ratio_low,
        clip_ratio if clip_ratio_high is None else clip_ratio_high,
    )


def check_clip_range(clip_ratio_low: float, clip_ratio_high: float) -> None:
    """Validate the clip range [1 - low, 1 + high]."""
    check_number("clip_ratio_low", clip_ratio_low)
    check_number("clip_ratio_high", clip_ratio_high)
    if not 0 <= clip_ratio_low < 1:
        raise AlgoInputError(f"clip_ratio_low must be in [0, 1) so that 1 - clip_ratio_low > 0; got {clip_ratio_low}")
    if clip_ratio_high < 0:
        raise AlgoInputError(f"clip_ratio_high must be >= 0; got {clip_ratio_high}")


def _check_clip(clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float) -> None:
    """Validate the clip range [1 - low, 1 + high] and the dual-clip constant c."""
    check_clip_range(clip_ratio_low, clip_ratio_high)
    check_number("clip_ratio_c", clip_ratio_c)
    if clip_ratio_c <= 1:
        raise AlgoInputError(f"clip_ratio_c (dual clip) must be > 1; got {clip_ratio_c}")


def check_loss_inputs(log_prob, old_name, old_log_prob, advantages, response_mask, weights=None, normalizers=None):
    """Shape, type and value checks shared by the policy losses; returns the bool mask (B, T) and Checks."""
    check_tensor("log_prob", log_prob)
    mask, checks = check_masked_terms(
        "response_mask",
        response_mask,
        normalizers,
        log_prob=log_prob,
        **{old_name: old_log_prob},
        advantages=advantages,
        weights=weights,
    )
    if weights is not None:
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


def _ppo_clip_terms(log_prob, old_log_prob, advantages, mask, weights, low, high, c, mode, normalizers, scale):
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
    pg_loss = agg_loss_unchecked(pg_losses, mask, mode, normalizers, scale)

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
    normalizers: LossNormalizers | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO loss (0-dim fp32, differentiable in log_prob) and its metrics; verl's compute_policy_loss_vanilla.

    log_prob is log pi_theta, old_log_prob is log pi_prox, advantages A; all (B, T). response_mask is the loss
    mask: after rollout correction, the modified_response_mask (rejected tokens are not in it). Per token:
    r = exp(clamp(log_prob - old_log_prob, -20, 20)); loss = max(-A r, -A clip(r, 1 - low, 1 + high)),
    capped at -c A where A < 0 (dual clip); times weights (the detached IS weights) if given; aggregated by
    loss_agg_mode over response_mask with normalizers (default: this batch's own counts; pass the whole
    mini-batch's to get a micro-batch's share, see dppo.algo.aggregation); loss_scale_factor replaces T in
    seq-mean-token-sum-norm. Registered as loss_mode "vanilla" (dppo.algo.get_policy_loss_fn).
    Metrics (python floats, over the tokens of response_mask):
      actor/pg_loss: the loss;  actor/pg_clipfrac: fraction with -A clip(r) > -A r (clip active);
      actor/pg_clipfrac_lower: fraction with A < 0 and the dual-clip cap active;
      actor/ppo_kl: mean of old_log_prob - log_prob;  actor/ratio_mean, actor/ratio_max, actor/ratio_min.
    """
    mask, checks = check_loss_inputs(
        log_prob, "old_log_prob", old_log_prob, advantages, response_mask, weights, normalizers
    )
    _check_clip(clip_ratio_low, clip_ratio_high, clip_ratio_c)
    check_loss_scale_factor(loss_scale_factor)
    loss, metrics = _ppo_clip_terms(
        log_prob,
        old_log_prob,
        advantages,
        mask,
        weights,
        clip_ratio_low,
        clip_ratio_high,
        clip_ratio_c,
        loss_agg_mode,
        normalizers,
        loss_scale_factor,
    )
    return loss, to_floats(metrics, checks)


# ---------------------------------------------------------------------------------------------------
# Bypass mode (pi_prox := pi_behav): the POLICY_LOSSES registry
# ---------------------------------------------------------------------------------------------------


def ppo_clip_bypass_loss(
    log_prob,
    rollout_log_prob,
    advantages,
    loss_mask,
    is_weights=None,
    *,
    clip_ratio_low=0.2,
    clip_ratio_high=0.2,
    clip_ratio_c=3.0,
    loss_agg_mode="token-mean",
    normalizers=None,
    loss_scale_factor=None,
):
    """Bypass "ppo_clip": policy_loss against the rollout (r = pi_theta / pi_behav) over loss_mask.

    is_weights are ignored: the PPO ratio already is the correction, and weighting it again would count it twice
    (verl's rule). loss_mask is the response mask after rejection.
    """
    return policy_loss(
        log_prob,
        rollout_log_prob,
        advantages,
        loss_mask,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        loss_agg_mode=loss_agg_mode,
        normalizers=normalizers,
        loss_scale_factor=loss_scale_factor,
    )


def reinforce_bypass_loss(
    log_prob,
    rollout_log_prob,
    advantages,
    loss_mask,
    is_weights=None,
    *,
    clip_ratio_low=0.2,
    clip_ratio_high=0.2,
    clip_ratio_c=3.0,
    loss_agg_mode="token-mean",
    normalizers=None,
    loss_scale_factor=None,
):
    """Bypass "reinforce": -A * log pi_theta * w over loss_mask (w = is_weights, detached; 1 if None), as verl.

    REINFORCE has no ratio to clip: the clip arguments are validated and otherwise unused (every POLICY_LOSSES
    entry takes the same arguments); actor/pg_clipfrac and actor/pg_clipfrac_lower are reported as 0.
    actor/ppo_kl is the mean of rollout_log_prob - log_prob as it is (verl's: REINFORCE never exponentiates the
    log-ratio, so it is not clamped); the ratio metrics clamp it at +-20 before exp.
    """
    mask, checks = check_loss_inputs(
        log_prob, "rollout_log_prob", rollout_log_prob, advantages, loss_mask, is_weights, normalizers
    )
    _check_clip(clip_ratio_low, clip_ratio_high, clip_ratio_c)
    check_loss_scale_factor(loss_scale_factor)
    logp = torch.where(mask, log_prob.float(), 0.0)  # (B, T), differentiable
    adv = torch.where(mask, advantages.detach().float(), 0.0)
    pg_losses = -adv * logp
    if is_weights is not None:
        pg_losses = pg_losses * torch.where(mask, is_weights.detach().float(), 0.0)
    pg_loss = agg_loss_unchecked(pg_losses, mask, loss_agg_mode, normalizers, loss_scale_factor)
    with torch.no_grad():
        log_ratio = masked_log_ratio(log_prob.detach(), rollout_log_prob, mask)  # (B, T), log pi_theta / pi_behav
        zero = pg_loss.new_zeros(())
        metrics = {
            "actor/pg_loss": pg_loss.detach(),
            "actor/pg_clipfrac": zero,
            "actor/pg_clipfrac_lower": zero,
            **_ratio_metrics(log_ratio, torch.exp(log_ratio), mask),
            "actor/ppo_kl": masked_mean(-unclamped_log_ratio(log_prob.detach(), rollout_log_prob, mask), mask),
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
    normalizers: LossNormalizers | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy loss without the proximal recompute (pi_prox := pi_behav); verl's compute_policy_loss_bypass_mode.

    The rollout correction is computed on pi_theta / pi_behav (log_prob detached against rollout_log_prob, under
    config): its rejection mask is the loss mask of the config.loss_type loss from POLICY_LOSSES, and its IS
    weights weight "reinforce" ("ppo_clip" ignores them). Returns the loss and the loss's metrics plus the
    rollout_corr/* ones. config.bypass_mode must be True. normalizers: see policy_loss (None: the counts of the
    rejection-modified mask).
    """
    if not isinstance(config, RolloutCorrectionConfig):
        raise TypeError(f"config must be a RolloutCorrectionConfig; got {type(config).__name__}")
    if not config.bypass_mode:
        raise AlgoInputError(
            "bypass_policy_loss needs algorithm.rollout_correction.bypass_mode=True; with bypass_mode=False "
            "recompute old_log_prob and use compute_rollout_correction_and_rejection_mask + policy_loss"
        )
    mask, checks = check_loss_inputs(log_prob, "rollout_log_prob", rollout_log_prob, advantages, response_mask)
    with torch.no_grad():
        is_weights, loss_mask, rc_metrics = rollout_correction_tensors(log_prob, rollout_log_prob, mask, config)
    rc_metrics = to_floats(rc_metrics, checks)
    loss, metrics = get_policy_loss(config.loss_type)(
        log_prob,
        rollout_log_prob,
        advantages,
        loss_mask,
        is_weights,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        loss_agg_mode=loss_agg_mode,
        normalizers=normalizers,
        loss_scale_factor=loss_scale_factor,
    )
    return loss, {**metrics, **rc_metrics}


# ---------------------------------------------------------------------------------------------------
# Entropy bonus
# ---------------------------------------------------------------------------------------------------


def entropy_bonus(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float,
    loss_agg_mode: str = "token-mean",
    normalizers: LossNormalizers | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss term -coef * agg(entropy) (add it to the policy loss to reward entropy) and {"actor/entropy": agg}.

    Aggregated over response_mask (the loss mask) with normalizers and loss_scale_factor, as the policy loss.
    """
    mask, checks = check_added_term(coef, response_mask, normalizers, loss_scale_factor, entropy=entropy)
    mean_entropy = agg_loss_unchecked(entropy.float(), mask, loss_agg_mode, normalizers, loss_scale_factor)
    return -coef * mean_entropy, to_floats({"actor/entropy": mean_entropy}, checks)
