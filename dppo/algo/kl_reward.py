"""verl's KL penalty in the reward (algorithm.use_kl_in_reward): token-level rewards minus beta * KL to a reference.

    rewards (B, T) = token_level_scores - beta * kl_penalty(log_prob, ref_log_prob) * response_mask

beta comes from a KL controller (verl's kl_ctrl): FixedKLController keeps kl_coef; AdaptiveKLController
(Ziegler et al. 2019, https://arxiv.org/abs/1909.08593) multiplies it after each batch by
1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon, n_steps the batch's sequence count. The
batch's KL (actor/reward_kl_penalty) is the mean over sequences of each sequence's mean over its valid tokens,
as verl 0.9.1's apply_kl_penalty computes it (a sequence without valid tokens counts as 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dppo.algo_names import KL_CONTROLLER_TYPES
from dppo.algo._common import (
    AlgoInputError,
    checked_mask,
    lookup,
)
from dppo.algo.kl import kl_penalty


def _check_positive(name: str, value) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not (ok and value > 0):
        raise AlgoInputError(f"{name} must be a finite number > 0; got {value!r}")
    return float(value)


@dataclass
class FixedKLController:
    """beta stays kl_coef."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing: the coefficient is fixed."""


@dataclass
class AdaptiveKLController:
    """beta moves towards the KL that makes current_kl equal target, by at most 20% x n_steps / horizon a batch."""

    value: float
    target: float
    horizon: float

    def __post_init__(self) -> None:
        _check_positive("kl_ctrl.target_kl", self.target)
        _check_positive("kl_ctrl.horizon", self.horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


def get_kl_controller(
    type: str = "fixed", kl_coef: float = 0.001, target_kl: float = 0.1, horizon: float = 10000
) -> FixedKLController | AdaptiveKLController:
    """verl's kl_ctrl (type fixed|adaptive, kl_coef, target_kl, horizon; verl 0.9.1's defaults)."""
    lookup(dict.fromkeys(KL_CONTROLLER_TYPES), type, "kl_ctrl.type")
    if isinstance(kl_coef, bool) or not isinstance(kl_coef, (int, float)) or not math.isfinite(kl_coef) or kl_coef < 0:
        raise AlgoInputError(f"kl_ctrl.kl_coef must be a finite number >= 0; got {kl_coef!r}")
    if type == "fixed":
        return FixedKLController(float(kl_coef))
    return AdaptiveKLController(float(kl_coef), target_kl, horizon)


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    kl_penalty_kind: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level rewards (B, T) fp32 = scores - beta * KL(pi || pi_ref) on valid tokens, then kl_ctrl updated with
    the batch's KL; returns them and {"actor/reward_kl_penalty": that KL, "actor/reward_kl_penalty_coeff": beta}
    (beta before the update, as verl reports it). log_prob is the policy's log-probs (verl's old_log_probs),
    ref_log_prob the reference's, all (B, T); kl_penalty_kind a dppo.algo.KL_PENALTIES name."""
    mask = checked_mask(
        "response_mask",
        response_mask,
        token_level_scores=token_level_scores,
        log_prob=log_prob,
        ref_log_prob=ref_log_prob,
    )
    with torch.no_grad():
        kld = kl_penalty(log_prob.detach(), ref_log_prob, kl_penalty_kind, response_mask=mask)  # (B, T), 0 if masked
        beta = kl_ctrl.value
        rewards = token_level_scores.float() - beta * kld  # (B, T)
        per_seq = kld.sum(-1) / (mask.sum(-1) + 1e-8)  # (B,) verl's masked_mean over each row
        current_kl = float(per_seq.mean()) if per_seq.numel() else 0.0
    kl_ctrl.update(current_kl=current_kl, n_steps=mask.shape[0])
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
