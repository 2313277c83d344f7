"""verl 0.9.1's covariance-based losses (Cui et al., "The Entropy Mechanism of RL for Reasoning LMs"):
clip_cov cuts the gradient of a few random tokens whose covariance Cov(A, log pi) lies in [lb, ub]; kl_cov adds
a |log r| penalty on the tokens of largest covariance.

Both act on the tokens of the batch they are given: under micro-batching, on each micro-batch, as verl does.
clip_cov's draw uses LossTerms.generator (a CPU torch.Generator; None: torch's global one, as verl); the
trainer seeds it from trainer.seed, the optimizer step and the micro-batch's token ids, so a micro-batch
draws the same tokens at any world size when its sequences are the same. kl_cov's top-k is
deterministic. Conventions as dppo.algo.losses_ratio.
"""

from __future__ import annotations

import torch

from dppo.algo._common import check_number
from dppo.algo._loss_terms import LossTerms
from dppo.algo.losses import check_clip_range
from dppo.algo.losses_ratio import _clipped_max

Terms = tuple[torch.Tensor, dict[str, torch.Tensor]]


def _draw(candidates: torch.Tensor, count: int, generator: torch.Generator | None) -> torch.Tensor:
    """Up to count positions (K, 2) drawn without replacement from the True entries of candidates (B, T),
    as verl draws them: a permutation of the row-major candidate list, its first count."""
    idx = torch.nonzero(candidates)  # (N, 2), row-major
    perm = torch.randperm(len(idx), generator=generator)[:count]  # on the CPU, as verl's
    return idx[perm.to(idx.device)]


def clip_cov_terms(
    x: LossTerms,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_cov_ratio: float,
    clip_cov_lb: float,
    clip_cov_ub: float,
) -> Terms:
    """Clip-Cov: the PPO clipped loss (r = exp(log r), unclamped as in verl, no dual clip) with its gradient cut
    (the token's loss set to 0) on max(1, int(clip_cov_ratio x valid tokens)) tokens drawn at random among the
    valid, unclipped ones with clip_cov_lb < (A - mean A)(log pi - mean log pi) < clip_cov_ub.
    pg_clipfrac is the fraction cut."""
    check_clip_range(clip_ratio_low, clip_ratio_high)
    check_number("clip_cov_ratio", clip_cov_ratio, above=0)
    check_number("clip_cov_lb", clip_cov_lb)
    check_number("clip_cov_ub", clip_cov_ub)
    log_ratio = x.log_ratio()  # (B, T)
    ratio = torch.exp(log_ratio)
    pg_losses, clipped = _clipped_max(
        -x.advantages * ratio, -x.advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high), x.mask
    )  # (B, T) each
    with torch.no_grad():
        cov = (x.advantages - x.mean(x.advantages)) * (x.log_prob - x.mean(x.log_prob))  # (B, T)
        candidates = x.mask & ~clipped & (cov > clip_cov_lb) & (cov < clip_cov_ub)
        count = max(int(clip_cov_ratio * int(x.mask.sum())), 1)
        cut = _draw(candidates, count, x.generator)  # (K, 2)
        keep = torch.ones_like(pg_losses)
        keep[cut[:, 0], cut[:, 1]] = 0.0
    metrics = {"actor/pg_clipfrac": x.mean((keep == 0).float()), "actor/ppo_kl": x.mean(-log_ratio)}
    return x.weighted(pg_losses * keep), metrics


def kl_cov_terms(x: LossTerms, kl_cov_ratio: float, ppo_kl_coef: float) -> Terms:
    """KL-Cov: -A r (r = exp(log r), unclamped, no clip), plus ppo_kl_coef |log r| on the max(1, int(kl_cov_ratio x
    valid tokens)) valid tokens of largest (A - mean A)(log pi - mean log pi). actor/ppo_kl is the mean of
    |log r| here (verl's)."""
    check_number("kl_cov_ratio", kl_cov_ratio, above=0)
    check_number("ppo_kl_coef", ppo_kl_coef)
    log_ratio = x.log_ratio()  # (B, T)
    abs_kl = log_ratio.abs()
    pg_losses = -x.advantages * torch.exp(log_ratio)
    with torch.no_grad():
        adv, logp = x.advantages[x.mask], x.log_prob[x.mask]  # (N,) each, row-major as verl's
        penalized = torch.zeros(x.mask.numel(), dtype=torch.bool, device=x.mask.device)
        if len(adv):
            cov = (adv - adv.mean()) * (logp - logp.mean())  # (N,)
            top = torch.topk(cov, max(1, int(len(cov) * kl_cov_ratio)), largest=True).indices
            penalized[torch.nonzero(x.mask.reshape(-1)).squeeze(1)[top]] = True
        penalized = penalized.reshape(x.mask.shape)  # (B, T)
    pg_losses = torch.where(penalized, pg_losses + ppo_kl_coef * abs_kl, pg_losses)
    return x.weighted(pg_losses), {"actor/ppo_kl": x.mean(abs_kl)}
