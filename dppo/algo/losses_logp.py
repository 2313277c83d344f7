"""verl 0.9.1's policy losses on log pi_theta itself: gpg (plain policy gradient), dro (quadratic log-ratio
penalty), dppo_tv and dppo_kl (DPPO-Binary: a token whose probability already moved past a TV or binary-KL
bound in the advantage's direction is left out, and the rest are weighted by the truncated ratio).

The dppo_* losses are "Divergence PPO" (arXiv 2602.04879), not this project's Decoupled PPO; under Decoupled
PPO their old_log_prob is pi_prox like every loss's. Conventions as dppo.algo.losses_ratio.
"""

from __future__ import annotations

import torch

from dppo.algo._common import LOG_RATIO_BOUND, AlgoInputError, check_number
from dppo.algo._loss_terms import LossTerms
from dppo.algo.losses import check_clip_range

Terms = tuple[torch.Tensor, dict[str, torch.Tensor]]

# DPPO-Binary-KL's smoothing inside log((1 - p_old) / (1 - p)), as verl's.
BINARY_KL_EPS = 1e-8


def gpg_terms(x: LossTerms) -> Terms:
    """GPG: -A log pi_theta (no ratio, no clip). verl reports no metric; ppo_kl (mean of -log r) is dppo's."""
    return x.weighted(-x.log_prob * x.advantages), {"actor/ppo_kl": x.mean(-x.log_ratio())}


def dro_terms(x: LossTerms, dro_beta: float | None) -> Terms:
    """DRO: -(A log pi_theta - beta / 2 (log r)^2), beta = dro_beta (required, > 0; verl has no default)."""
    if dro_beta is None:
        raise AlgoInputError("dro_beta must be a number > 0 for loss_mode 'dro' (verl has no default); got None")
    check_number("dro_beta", dro_beta, above=0)
    log_ratio = x.log_ratio()  # (B, T)
    pg_losses = -(x.log_prob * x.advantages - 0.5 * dro_beta * log_ratio.square())
    return x.weighted(pg_losses), {"actor/ppo_kl": x.mean(-log_ratio)}


def _divergence_terms(x: LossTerms, keep: torch.Tensor, log_ratio: torch.Tensor, clip_ratio_c: float) -> Terms:
    """-A sg[min(r, c)] log pi_theta over the kept tokens, and the metrics both DPPO-Binary losses report."""
    ratio = torch.exp(log_ratio).detach()  # (B, T)
    truncated = ratio.clamp(max=clip_ratio_c)
    keep = keep.detach().float()
    pg_losses = -x.advantages * truncated * x.log_prob * keep
    metrics = {
        "actor/pg_clipfrac": x.mean(1.0 - keep),
        "actor/ppo_kl": x.mean(-log_ratio),
        "actor/pg_clipfrac_lower": x.mean((ratio > clip_ratio_c).float() * keep),
    }
    return x.weighted(pg_losses), metrics


def _check_divergence(clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float) -> None:
    check_clip_range(clip_ratio_low, clip_ratio_high)
    check_number("clip_ratio_c", clip_ratio_c, above=0)


def dppo_tv_terms(x: LossTerms, clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float) -> Terms:
    """DPPO-Binary-TV: keep a token unless p - p_old > clip_ratio_high (A > 0) or p - p_old < -clip_ratio_low
    (A <= 0); here the clip ratios are probability (TV) bounds. clip_ratio_c truncates the ratio weight (verl's
    code reads 20 if the key is absent, but its ActorConfig always has clip_ratio_c, 3 by default)."""
    _check_divergence(clip_ratio_low, clip_ratio_high, clip_ratio_c)
    log_ratio = x.log_ratio().clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    delta = torch.exp(x.log_prob) - torch.exp(x.old_log_prob)  # (B, T), p - p_old
    keep = torch.where(x.advantages > 0, delta <= clip_ratio_high, delta >= -clip_ratio_low)
    return _divergence_terms(x, keep, log_ratio, clip_ratio_c)


def dppo_kl_terms(x: LossTerms, clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float) -> Terms:
    """DPPO-Binary-KL: keep a token unless the binary KL(p_old || p) of the sampled token exceeds clip_ratio_high
    while p rose (A > 0), or clip_ratio_low while p fell (A <= 0). clip_ratio_c as dppo_tv's."""
    _check_divergence(clip_ratio_low, clip_ratio_high, clip_ratio_c)
    log_ratio = x.log_ratio().clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    prob, old_prob = torch.exp(x.log_prob), torch.exp(x.old_log_prob)  # (B, T) each
    binary_kl = old_prob * (x.old_log_prob - x.log_prob) + (1 - old_prob) * torch.log(
        (1.0 - old_prob + BINARY_KL_EPS) / (1.0 - prob + BINARY_KL_EPS)
    )
    keep_pos = (binary_kl <= clip_ratio_high) | (prob <= old_prob)
    keep_neg = (binary_kl <= clip_ratio_low) | (prob >= old_prob)
    keep = torch.where(x.advantages > 0, keep_pos, keep_neg)
    return _divergence_terms(x, keep, log_ratio, clip_ratio_c)
