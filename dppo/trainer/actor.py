"""One optimizer step of the policy on a trigger's mini-batch, micro-batched with gradient accumulation.

The loss math lives in dppo.algo; this module only slices micro-batches, weights each micro-batch's loss
so that the accumulated gradient equals the gradient of the whole mini-batch's loss, and steps.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from dppo.algo import (
    agg_loss,
    bypass_policy_loss,
    entropy_bonus,
    entropy_from_logits,
    get_advantage_estimator,
    kl_loss,
    log_probs_from_logits,
    policy_loss,
)
from dppo.models import forward_response_logits
from dppo.rollout import TrainBatch

# loss_fn(logp, prox_logp, behav_logp, advantages, response_mask, weights) -> (loss, metrics), all (b, R)
LossFn = Callable[..., "tuple[torch.Tensor, dict[str, float]]"]


def _clip_settings(actor_cfg) -> dict:
    """The clip and aggregation keyword arguments every policy loss takes, from the actor config."""
    return dict(clip_ratio_low=actor_cfg.clip_ratio_low, clip_ratio_high=actor_cfg.clip_ratio_high,
                clip_ratio_c=actor_cfg.clip_ratio_c, loss_agg_mode=actor_cfg.loss_agg_mode)  # fmt: skip


def decoupled_loss(actor_cfg) -> LossFn:
    """Decoupled PPO: ratio pi_theta / pi_prox, times the rollout-correction weight pi_prox / pi_behav."""
    clip = _clip_settings(actor_cfg)

    def loss_fn(logp, prox_logp, behav_logp, advantages, mask, weights):
        return policy_loss(logp, prox_logp, advantages, mask, weights=weights, **clip)

    return loss_fn


def bypass_loss(actor_cfg, rollout_correction) -> LossFn:
    """Bypass mode: pi_prox := pi_behav; the variant is rollout_correction.loss_type."""
    clip = _clip_settings(actor_cfg)

    def loss_fn(logp, prox_logp, behav_logp, advantages, mask, weights):
        return bypass_policy_loss(logp, behav_logp, advantages, mask, rollout_correction, **clip)

    return loss_fn


def micro_batch_share(mode: str, micro_mask: torch.Tensor, mask: torch.Tensor) -> float:
    """Factor that turns a micro-batch's aggregated loss into its share of the mini-batch's aggregated loss."""
    if mode == "token-mean":
        return float(micro_mask.sum()) / max(1.0, float(mask.sum()))
    if mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        return float(micro_mask.any(-1).sum()) / max(1.0, float(mask.any(-1).sum()))
    if mode == "seq-mean-token-sum-norm":
        return 1.0  # sum / T: the micro-batch sums add up
    # Unknown modes are rejected by agg_loss with the list of valid names.
    agg_loss(mask.float(), mask, mode)
    raise AssertionError("unreachable")


def _merge(total: dict[str, float], metrics: dict[str, float], share: float) -> None:
    for key, value in metrics.items():
        if key.endswith("_max"):
            total[key] = max(total.get(key, -math.inf), value)
        elif key.endswith("_min"):
            total[key] = min(total.get(key, math.inf), value)
        else:
            total[key] = total.get(key, 0.0) + share * value


def update_policy(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    prox_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor | None,
    loss_fn: LossFn,
    actor_cfg,
    temperature: float,
    ref_logp: torch.Tensor | None = None,
) -> dict[str, float]:
    """Accumulate gradients over micro-batches of the mini-batch, clip, and take one optimizer step."""
    mask = batch.response_mask  # (B, R)
    response_length = batch.response_length
    prompt_length = batch.input_ids.shape[1] - response_length
    mode = actor_cfg.loss_agg_mode
    metrics: dict[str, float] = {}
    optimizer.zero_grad(set_to_none=True)
    for start in range(0, batch.num_sequences, actor_cfg.micro_batch_size):
        sl = slice(start, start + actor_cfg.micro_batch_size)
        logits = forward_response_logits(model, batch.input_ids[sl], response_length)  # (b, R, V)
        logp = log_probs_from_logits(logits, batch.input_ids[sl, prompt_length:], temperature)  # (b, R)
        loss, m = loss_fn(logp, prox_logp[sl], batch.behav_logp[sl], advantages[sl], mask[sl],
                          None if weights is None else weights[sl])  # fmt: skip
        if actor_cfg.entropy_coeff > 0:
            entropy = entropy_from_logits(logits, temperature=temperature)  # (b, R)
            bonus, em = entropy_bonus(entropy, mask[sl], actor_cfg.entropy_coeff, mode)
            loss, m = loss + bonus, {**m, **em}
        if ref_logp is not None:
            kl, km = kl_loss(logp, ref_logp[sl], mask[sl], actor_cfg.kl_loss_coef, actor_cfg.kl_loss_type, mode)
            loss, m = loss + kl, {**m, **km}
        share = micro_batch_share(mode, mask[sl], mask)
        (loss * share).backward()
        _merge(metrics, m, share)
    max_norm = actor_cfg.grad_clip if actor_cfg.grad_clip > 0 else math.inf
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    if math.isfinite(grad_norm):
        optimizer.step()
    else:  # a non-finite gradient would poison the weights and Adam's moments; skip this step
        optimizer.zero_grad(set_to_none=True)
    metrics["actor/grad_norm"] = grad_norm
    metrics["actor/step_skipped"] = float(not math.isfinite(grad_norm))
    return metrics


def advantage_fn(algorithm_cfg) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """advantages(scores (B,), group_index (B,), response_mask (B, R)) -> (B, R) for algorithm.adv_estimator."""
    estimator = get_advantage_estimator(algorithm_cfg.adv_estimator)
    if algorithm_cfg.adv_estimator == "grpo":
        return functools.partial(estimator, norm_by_std=algorithm_cfg.norm_adv_by_std_in_grpo)
    return estimator
