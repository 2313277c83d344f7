"""KL penalty of the current policy to a reference policy: per-token k1, k2, k3 estimators and a loss term."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dppo.algo._common import (
    Checks,
    LossNormalizers,
    as_mask,
    check_added_term,
    check_same_shape,
    check_tensor,
    lookup,
    to_floats,
    unclamped_log_ratio,
)
from dppo.algo.aggregation import agg_loss_unchecked

# verl clamps log(pi_ref / pi) to +-20 before exp in k3, and k3 itself to +-10, so one outlier token cannot
# dominate the loss. k1 and k2 are not clamped (as in verl).
K3_LOG_RATIO_BOUND = 20.0
K3_BOUND = 10.0


def _k1(log_ratio: torch.Tensor) -> torch.Tensor:
    """log pi - log pi_ref: unbiased, can be negative."""
    return log_ratio


def _abs(log_ratio: torch.Tensor) -> torch.Tensor:
    """|log pi - log pi_ref|: >= 0, biased."""
    return log_ratio.abs()


def _k2(log_ratio: torch.Tensor) -> torch.Tensor:
    """0.5 (log pi - log pi_ref)^2: biased, >= 0, its gradient is the gradient of KL."""
    return 0.5 * log_ratio.square()


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """pi_ref/pi - log(pi_ref/pi) - 1: unbiased, >= 0, low variance (Schulman); written as verl writes it."""
    kl = (-log_ratio).clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)  # log pi_ref / pi
    return (torch.exp(kl) - kl - 1).clamp(-K3_BOUND, K3_BOUND)


def _straight_through(estimator: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """estimator's value with k2's gradient (verl's "+" names): k1 and k3 estimate KL without bias but their
    expected gradient is not KL's; k2's is."""

    def kl(log_ratio: torch.Tensor) -> torch.Tensor:
        k2 = _k2(log_ratio)
        return k2 - k2.detach() + estimator(log_ratio).detach()

    kl.__doc__ = f"{estimator.__doc__} Value as is, gradient of k2 (straight-through)."
    return kl


# verl 0.9.1's names: its aliases of the same estimators, and each name + "+" for the straight-through variant
# (for k2 / mse the "+" changes nothing: value and gradient are k2's either way).
_BASE_PENALTIES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": _k1,
    "kl": _k1,
    "k2": _k2,
    "mse": _k2,
    "k3": _k3,
    "low_var_kl": _k3,
    "abs": _abs,
}
KL_PENALTIES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    **_BASE_PENALTIES,
    **{f"{name}+": _straight_through(fn) for name, fn in _BASE_PENALTIES.items()},
}


def kl_penalty(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    kind: str = "k1",
    *,
    response_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate (B, T) fp32, differentiable in log_prob; kind is a KL_PENALTIES name.

    With log r = log_prob - ref_log_prob: k1 (kl) = log r, abs = |log r|, k2 (mse) = (log r)^2 / 2,
    k3 (low_var_kl) = exp(-log r) + log r - 1 with log r clamped to +-20 and k3 to +-10, as verl's kl_penalty;
    a name with "+" (k3+, low_var_kl+, ...) has that value and k2's gradient (straight-through). With response_mask the result is 0 at
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
    return estimator(unclamped_log_ratio(log_prob, ref_log_prob, mask))  # (B, T)


def kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float,
    kind: str = "k3",
    loss_agg_mode: str = "token-mean",
    normalizers: LossNormalizers | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss term coef * agg(kl_penalty) to add to the policy loss, and {"actor/kl_loss", "actor/kl_coef"}.

    Aggregated over response_mask (the loss mask) with normalizers and loss_scale_factor, as the policy loss.
    """
    mask, checks = check_added_term(
        coef, response_mask, normalizers, loss_scale_factor, log_prob=log_prob, ref_log_prob=ref_log_prob
    )
    estimator = lookup(KL_PENALTIES, kind, "KL penalty kind")
    per_token = estimator(unclamped_log_ratio(log_prob, ref_log_prob, mask))  # (B, T)
    kl = agg_loss_unchecked(per_token, mask, loss_agg_mode, normalizers, loss_scale_factor)
    metrics = to_floats({"actor/kl_loss": kl.detach()}, checks)
    return coef * kl, {**metrics, "actor/kl_coef": float(coef)}
