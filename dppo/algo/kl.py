"""KL penalty of the current policy to a reference policy: per-token k1, k2, k3 estimators and a loss term."""

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
    to_floats,
)
from dppo.algo.losses import agg_loss_unchecked

# verl clamps k3 to this bound so one outlier token cannot dominate the loss.
K3_BOUND = 10.0


def _k1(log_ratio: torch.Tensor) -> torch.Tensor:
    """log pi - log pi_ref: unbiased, can be negative."""
    return log_ratio


def _k2(log_ratio: torch.Tensor) -> torch.Tensor:
    """0.5 (log pi - log pi_ref)^2: biased, >= 0, its gradient is the gradient of KL."""
    return 0.5 * log_ratio.square()


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """pi_ref/pi - 1 - log(pi_ref/pi): unbiased, >= 0, low variance (Schulman), clamped to K3_BOUND."""
    neg = -log_ratio  # log pi_ref / pi
    return (torch.exp(neg) - 1.0 - neg).clamp(max=K3_BOUND)


# verl's names for the same estimators are accepted as aliases.
KL_PENALTIES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": _k1,
    "kl": _k1,
    "k2": _k2,
    "mse": _k2,
    "k3": _k3,
    "low_var_kl": _k3,
}


def kl_penalty(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    kind: str = "k1",
    *,
    response_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate (B, T) fp32, differentiable in log_prob; kind is "k1", "k2" or "k3".

    log r = clamp(log_prob - ref_log_prob, -20, 20); k1 = log r, k2 = (log r)^2 / 2,
    k3 = exp(-log r) - 1 + log r (clamped to 10, as verl does). With response_mask the result is 0 at
    masked-out positions (whatever they hold); without it every position is valid. NaN/inf at a valid
    position raises NonFiniteError. Per element, so any shape works; the trainer passes (B, T).
    """
    estimator = lookup(KL_PENALTIES, kind, "KL penalty kind")
    check_tensor("log_prob", log_prob)
    check_same_shape("log_prob", log_prob, ref_log_prob=ref_log_prob)
    mask = None
    if response_mask is not None:
        mask = as_mask("response_mask", response_mask)
        check_same_shape("response_mask", mask, log_prob=log_prob)
    checks = Checks(mask)  # without a mask every position is valid
    checks.finite("log_prob", log_prob)
    checks.finite("ref_log_prob", ref_log_prob)
    to_floats({}, checks)
    return estimator(masked_log_ratio(log_prob, ref_log_prob, mask))  # (B, T)


def kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float,
    kind: str = "k3",
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss term coef * agg(kl_penalty) to add to the policy loss, and {"actor/kl_loss", "actor/kl_coef"}."""
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not math.isfinite(coef):
        raise AlgoInputError(f"coef must be a finite number; got {coef!r}")
    mask = as_mask("response_mask", response_mask)
    check_2d("response_mask", mask)
    check_tensor("log_prob", log_prob)
    check_same_shape("response_mask", mask, log_prob=log_prob, ref_log_prob=ref_log_prob)
    checks = Checks(mask)
    checks.finite("log_prob", log_prob)
    checks.finite("ref_log_prob", ref_log_prob)
    log_ratio = masked_log_ratio(log_prob, ref_log_prob, mask)  # (B, T)
    kl = agg_loss_unchecked(lookup(KL_PENALTIES, kind, "KL penalty kind")(log_ratio), mask, loss_agg_mode)
    metrics = to_floats({"actor/kl_loss": kl.detach()}, checks)
    return coef * kl, {**metrics, "actor/kl_coef": float(coef)}
