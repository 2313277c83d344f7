"""verl 0.9.1's ratio-shaped policy losses: gspo (sequence ratio), sapo (soft gate), geo_mean (GMPO), cispo
(clipped IS weight on log pi).

Each takes LossTerms (old_log_prob is pi_prox in Decoupled PPO, pi_behav in bypass) and its verl config keys,
and returns the per-token loss (B, T) with the IS weights applied, 0 at masked positions, and its metric
tensors; dppo.algo.loss_modes checks the inputs and aggregates. Where verl clips with torch.maximum, a strict
comparison picks the branch here (as dppo's vanilla does): the two agree wherever the branches differ and, on
a tie, give the same gradient.
"""

from __future__ import annotations

import torch

from dppo.algo._common import LOG_RATIO_BOUND, check_number
from dppo.algo._loss_terms import LossTerms
from dppo.algo.losses import check_clip_range

# verl clamps GSPO's token-level log sequence ratio at 10 (above only) before exp.
GSPO_LOG_RATIO_MAX = 10.0

Terms = tuple[torch.Tensor, dict[str, torch.Tensor]]


def _clipped_max(pg_losses1: torch.Tensor, pg_losses2: torch.Tensor, mask: torch.Tensor):
    """max(pg_losses1, pg_losses2) with the clipped branch only where strictly larger, and that mask (B, T)."""
    clipped = mask & (pg_losses2 > pg_losses1)
    return torch.where(clipped, pg_losses2, pg_losses1), clipped


def gspo_terms(x: LossTerms, clip_ratio_low: float, clip_ratio_high: float) -> Terms:
    """GSPO: the clipped objective on the sequence ratio s_i = exp(mean_t log r_it), with the token's own gradient.

    log s_it = sg[mean over the sequence's valid tokens of log r] + log pi_theta - sg[log pi_theta], clamped
    at 10 above; loss = max(-A s, -A clip(s, 1 - low, 1 + high)). ppo_kl is the mean of -log r, unclamped.
    """
    check_clip_range(clip_ratio_low, clip_ratio_high)
    log_ratio = x.log_ratio()  # (B, T), 0 at masked positions
    seq_log_ratio = log_ratio.sum(-1) / x.mask.sum(-1).clamp(min=1)  # (B,)
    log_seq_ratio = x.log_prob - x.log_prob.detach() + seq_log_ratio.detach()[:, None]  # (B, T)
    seq_ratio = torch.exp(log_seq_ratio.clamp(max=GSPO_LOG_RATIO_MAX))
    pg_losses1 = -x.advantages * seq_ratio
    pg_losses2 = -x.advantages * seq_ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses, clipped = _clipped_max(pg_losses1, pg_losses2, x.mask)
    metrics = {
        "actor/pg_clipfrac": x.mean(clipped.float()),
        "actor/ppo_kl": x.mean(-log_ratio),
        "actor/pg_clipfrac_lower": torch.zeros((), device=x.mask.device),
    }
    return x.weighted(pg_losses), metrics


def sapo_terms(x: LossTerms, tau_pos: float, tau_neg: float) -> Terms:
    """SAPO: a soft gate f(r) = sigmoid(tau (r - 1)) 4 / tau in place of the clip; tau_pos where A > 0, else tau_neg.

    r = exp(clamp(log r, +-20)); loss = -f(r) A. verl aggregates SAPO with seq-mean-token-mean whatever
    loss_agg_mode says (dppo.algo.loss_modes does the same).
    """
    check_number("tau_pos", tau_pos, above=0)
    check_number("tau_neg", tau_neg, above=0)
    log_ratio = x.log_ratio().clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)  # (B, T)
    taus = torch.where(x.advantages > 0, tau_pos, tau_neg)  # (B, T)
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    zero = torch.zeros((), device=x.mask.device)
    metrics = {"actor/pg_clipfrac": zero, "actor/ppo_kl": x.mean(-log_ratio), "actor/pg_clipfrac_lower": zero}
    return x.weighted(-gates * x.advantages), metrics


def geo_mean_terms(x: LossTerms, clip_ratio_low: float, clip_ratio_high: float) -> Terms:
    """GMPO: -A_i exp(mean_t clip'(log r_it)) per sequence, clip' clipping log r to [-low, high] where that lowers
    A log r (the pessimistic side), A_i the sequence's mean advantage.

    IS weights enter as their geometric mean over the sequence. The sequence's loss sits at its first valid
    token, so seq-mean-token-sum (dppo.algo.loss_modes) divides their sum by the sequences with a valid token
    (verl's torch.mean also counts rows without one; the two agree when every row has a valid token).
    """
    check_clip_range(clip_ratio_low, clip_ratio_high)
    log_ratio = x.log_ratio()  # (B, T), unclamped as in verl
    sign = torch.sign(x.advantages)
    clamped = log_ratio.clamp(-clip_ratio_low, clip_ratio_high)
    # sign * min(sign * log r, sign * clamped): the clamped value only where it is strictly more pessimistic
    pessimistic = torch.where(sign * clamped < sign * log_ratio, clamped, log_ratio) * (sign != 0)
    lengths = x.mask.sum(-1)  # (B,)
    seq_ratio = torch.exp(pessimistic.sum(-1) / (lengths + 1e-8))  # (B,)
    seq_adv = x.advantages.sum(-1) / (lengths + 1e-8)  # (B,)
    seq_losses = -seq_adv * seq_ratio  # (B,)
    if x.weights is not None:
        seq_losses = seq_losses * torch.exp(torch.log(x.weights + 1e-10).mul(x.mask).sum(-1) / (lengths + 1e-8))
    first_valid = torch.nn.functional.one_hot(x.mask.int().argmax(-1), x.mask.shape[-1]).bool() & x.mask  # (B, T)
    clipped = x.mask & (log_ratio != clamped)
    metrics = {
        "actor/pg_clipfrac": x.mean((clipped & (x.advantages > 0)).float()),
        "actor/ppo_kl": x.mean(-log_ratio),
        "actor/pg_clipfrac_lower": x.mean((clipped & (x.advantages < 0)).float()),
    }
    return torch.where(first_valid, seq_losses[:, None], 0.0), metrics


def cispo_terms(x: LossTerms, clip_ratio_low: float, clip_ratio_high: float) -> Terms:
    """CISPO: -sg[clip(r, 1 - low, 1 + high)] A log pi_theta: the clipped ratio weighs the REINFORCE gradient and
    carries none itself, so no token's gradient is cut. r = exp(clamp(log r, +-20))."""
    check_clip_range(clip_ratio_low, clip_ratio_high)
    log_ratio = x.log_ratio().clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio).detach()  # (B, T)
    clipped_ratio = ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    metrics = {
        "actor/pg_clipfrac": x.mean((ratio != clipped_ratio).float()),
        "actor/ppo_kl": x.mean(-log_ratio),
        "actor/pg_clipfrac_lower": torch.zeros((), device=x.mask.device),
    }
    return x.weighted(-clipped_ratio * x.advantages * x.log_prob), metrics
