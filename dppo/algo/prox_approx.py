"""AReaL's log-linear approximation of the proximal log-probs, and its error against the exact ones.

Decoupled PPO needs log pi_prox, the log-probs of the weights at the start of the sync cycle. The exact way
recomputes them with a forward pass over those weights; the approximation interpolates between the two
log-probs the trainer already has, per valid token:

    log pi_prox ~= log pi_behav + alpha * (log pi_theta - log pi_behav),
    alpha = clamp((v_prox - v_behav) / (v_theta - v_behav), 0, 1),   alpha = 0 where v_theta == v_behav,

versions counted in optimizer steps: v_prox the steps taken at the cycle start, v_theta = v_prox + k at
trigger k, v_behav those of the weights that sampled the token. It is exact at the two ends (alpha = 0 when
the sample is as new as pi_prox, alpha = 1 at trigger 0 where pi_theta is pi_prox) and assumes the log-probs
move linearly in the number of optimizer steps in between.
"""

from __future__ import annotations

import torch

from dppo.algo._common import (
    AlgoInputError,
    check_masked_terms,
    check_tensor,
    masked_log_ratio,
    masked_max,
    masked_mean,
    to_floats,
)


def _check_versions(v_prox: int, v_theta: int, v_behav: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """v_behav broadcast to (B, T) as fp64 (exact for any step count), after checking the three versions."""
    for name, value in (("v_prox", v_prox), ("v_theta", v_theta)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise AlgoInputError(f"{name} must be an int >= 0 (optimizer steps); got {value!r}")
    if v_theta < v_prox:
        raise AlgoInputError(f"v_theta={v_theta} < v_prox={v_prox}: pi_theta cannot be older than pi_prox")
    v_behav = check_tensor("v_behav", v_behav)
    if v_behav.is_floating_point() or v_behav.is_complex() or v_behav.dtype == torch.bool:
        raise AlgoInputError(f"v_behav must hold integer optimizer-step counts; got dtype {v_behav.dtype}")
    if v_behav.dim() == 1 and v_behav.shape[0] == shape[0]:
        v_behav = v_behav[:, None]  # (B, 1): one version per sequence
    elif v_behav.shape != shape:
        raise AlgoInputError(
            f"v_behav must have shape (B,) = ({shape[0]},) or (B, T) = {tuple(shape)}; got {tuple(v_behav.shape)}"
        )
    return v_behav.to(torch.float64).expand(shape)


def loglinear_alpha(v_prox: int, v_theta: int, v_behav: torch.Tensor) -> torch.Tensor:
    """alpha = clamp((v_prox - v_behav) / (v_theta - v_behav), 0, 1), 0 where v_theta == v_behav; v_behav's shape."""
    v_behav = v_behav.to(torch.float64)
    span = v_theta - v_behav
    alpha = torch.where(span != 0, (v_prox - v_behav) / torch.where(span != 0, span, 1.0), 0.0)
    return alpha.clamp(0.0, 1.0)


def loglinear_prox_log_prob(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    v_prox: int,
    v_theta: int,
    v_behav: torch.Tensor,
) -> torch.Tensor:
    """The log-linear approximation of log pi_prox (B, T) fp32, detached, 0 where response_mask is 0.

    log_prob is log pi_theta (its gradient is not followed), rollout_log_prob log pi_behav, both (B, T);
    v_behav (B,) or (B, T) integer optimizer-step counts of the weights that sampled each sequence (token).
    Raises AlgoInputError for bad versions or shapes and NonFiniteError for NaN/inf at a valid position.
    """
    mask, checks = check_masked_terms(
        "response_mask", response_mask, log_prob=log_prob, rollout_log_prob=rollout_log_prob
    )
    v_behav = _check_versions(v_prox, v_theta, v_behav, mask.shape)  # (B, T)
    to_floats({}, checks)
    with torch.no_grad():
        behav = torch.where(mask, rollout_log_prob.float(), 0.0)  # (B, T)
        step = torch.where(mask, log_prob.detach().float(), 0.0) - behav  # (B, T), log pi_theta - log pi_behav
        alpha = loglinear_alpha(v_prox, v_theta, v_behav).float()  # (B, T)
        return behav + alpha * step


def prox_approx_metrics(
    approx_log_prob: torch.Tensor,
    prox_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
) -> dict[str, float]:
    """How far an approximation of log pi_prox is from the exact one, over valid tokens.

    prox_approx/abs_err_mean, prox_approx/abs_err_max: of |approx - exact| log pi_prox;
    prox_approx/is_weight_abs_err_mean, prox_approx/is_weight_abs_err_max: of the IS weight pi_prox / pi_behav
    (each log-ratio clamped to [-20, 20] as everywhere in dppo.algo).
    """
    mask, checks = check_masked_terms(
        "response_mask",
        response_mask,
        approx_log_prob=approx_log_prob,
        prox_log_prob=prox_log_prob,
        rollout_log_prob=rollout_log_prob,
    )
    with torch.no_grad():
        err = masked_log_ratio(approx_log_prob, prox_log_prob, mask).abs()  # (B, T), 0 where masked
        w_approx = torch.exp(masked_log_ratio(approx_log_prob, rollout_log_prob, mask))
        w_exact = torch.exp(masked_log_ratio(prox_log_prob, rollout_log_prob, mask))
        w_err = torch.where(mask, (w_approx - w_exact).abs(), 0.0)  # (B, T)
        metrics = {
            "prox_approx/abs_err_mean": masked_mean(err, mask),
            "prox_approx/abs_err_max": masked_max(err, mask),
            "prox_approx/is_weight_abs_err_mean": masked_mean(w_err, mask),
            "prox_approx/is_weight_abs_err_max": masked_max(w_err, mask),
        }
    return to_floats(metrics, checks)
