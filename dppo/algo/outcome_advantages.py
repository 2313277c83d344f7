"""verl 0.9.1's other outcome-reward advantage estimators: REINFORCE++ (with and without a group baseline), OPO,
GRPO pass@k, GPG and ReMax. Each takes the outcome score of each sequence (B,), its prompt group (B,) and the
response mask (B, T), and returns per-token advantages (B, T) fp32, 0 at masked positions, computed as verl
computes them from token-level rewards that hold the score at the sequence's last valid token.

The batch-wide statistics (REINFORCE++'s whitening, GPG's alpha) are over the batch given: the trainer passes
the whole trigger's batch, as verl's driver does.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from dppo.algo._common import (
    AlgoInputError,
    NonFiniteError,
    ShapeMismatchError,
    check_number,
    check_tensor,
)
from dppo.algo.advantages import _broadcast, _check_inputs, _group_stats

GroupIndex = torch.Tensor | Sequence[Hashable]


def _whiten(values: torch.Tensor, mask: torch.Tensor, what: str) -> torch.Tensor:
    """verl's masked_whiten over the valid tokens of the batch: (x - mean) / sqrt(unbiased var + 1e-8), (B, T)."""
    count = int(mask.sum())
    if count < 2:
        raise AlgoInputError(f"{what} whitens over the batch's valid tokens and needs at least 2; got {count}")
    n = torch.tensor(float(count), device=values.device)
    mean = torch.where(mask, values, 0.0).sum() / (n + 1e-8)
    var = torch.where(mask, (values - mean).square(), 0.0).sum() / (n + 1e-8) * (n / (n - 1))
    return torch.where(mask, (values - mean) * torch.rsqrt(var + 1e-8), 0.0)


def reinforce_plus_plus_advantages(
    scores: torch.Tensor, group_index: GroupIndex, response_mask: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """REINFORCE++: the discounted return of each valid token (score x gamma^(valid tokens after it)), whitened
    over every valid token of the batch; group_index is not used (no baseline). verl's
    compute_reinforce_plus_plus_outcome_advantage."""
    check_number("gamma", gamma, minimum=0)
    scores, _, mask = _check_inputs(scores, group_index, response_mask)
    valid = mask.float()
    after = valid.flip(-1).cumsum(-1).flip(-1) - valid  # (B, T): valid tokens after each position
    returns = torch.where(mask, scores[:, None] * torch.pow(float(gamma), after), 0.0)  # (B, T)
    return _whiten(returns, mask, "reinforce_plus_plus")


def reinforce_plus_plus_baseline_advantages(
    scores: torch.Tensor, group_index: GroupIndex, response_mask: torch.Tensor
) -> torch.Tensor:
    """REINFORCE++-baseline: score minus its group's mean score (0 for a group of one), broadcast over the
    valid tokens and whitened over every valid token of the batch. verl's
    compute_reinforce_plus_plus_baseline_outcome_advantage."""
    scores, group, mask = _check_inputs(scores, group_index, response_mask)
    _, mean, _ = _group_stats(scores, group)  # (B,)
    return _whiten(_broadcast(scores - mean, mask), mask, "reinforce_plus_plus_baseline")


def opo_advantages(scores: torch.Tensor, group_index: GroupIndex, response_mask: torch.Tensor) -> torch.Tensor:
    """OPO: score minus its group's length-weighted mean score sum(len x score) / sum(len) (0 for a group of one),
    len = valid tokens. verl's compute_opo_outcome_advantage."""
    scores, group, mask = _check_inputs(scores, group_index, response_mask)
    lengths = mask.sum(-1).to(scores.dtype)  # (B,)
    _, inverse, counts = torch.unique(group, return_inverse=True, return_counts=True)
    weighted = torch.zeros(len(counts), dtype=scores.dtype, device=scores.device).index_add_(
        0, inverse, lengths * scores
    )  # (G,)
    total = torch.zeros(len(counts), dtype=scores.dtype, device=scores.device).index_add_(0, inverse, lengths)  # (G,)
    baseline = torch.where((counts > 1) & (total > 0), weighted / total.clamp(min=1), 0.0)  # (G,)
    return _broadcast(scores - baseline[inverse], mask)


def grpo_passk_advantages(
    scores: torch.Tensor,
    group_index: GroupIndex,
    response_mask: torch.Tensor,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> torch.Tensor:
    """GRPO pass@k: only each group's best response gets an advantage, best minus second best (over the group's
    std + epsilon when norm_adv_by_std_in_grpo); every group needs 2 or more responses. Ties go as torch.topk
    breaks them on the group's scores in batch order, as in verl's compute_grpo_passk_outcome_advantage."""
    check_number("epsilon", epsilon, above=0)
    scores, group, mask = _check_inputs(scores, group_index, response_mask)
    seq_adv = torch.zeros_like(scores)
    for g in torch.unique(group):
        members = torch.nonzero(group == g).squeeze(1)  # batch order
        if len(members) < 2:
            raise AlgoInputError(f"grpo_passk needs at least 2 responses per group; group {int(g)} has {len(members)}")
        top, top_idx = torch.topk(scores[members], 2)
        advantage = top[0] - top[1]
        if norm_adv_by_std_in_grpo:
            advantage = advantage / (torch.std(scores[members]) + epsilon)
        seq_adv[members[top_idx[0]]] = advantage
    return _broadcast(seq_adv, mask)


def gpg_advantages(scores: torch.Tensor, group_index: GroupIndex, response_mask: torch.Tensor) -> torch.Tensor:
    """GPG: alpha (score - group mean) (group of one: mean 0), alpha = B / (sequences with a nonzero score), so a
    batch where few responses score still gets a full-size gradient. verl's compute_gpg_outcome_advantage."""
    scores, group, mask = _check_inputs(scores, group_index, response_mask)
    _, mean, _ = _group_stats(scores, group)  # (B,)
    alpha = len(scores) / torch.count_nonzero(scores).clamp(min=1)
    return _broadcast(alpha * (scores - mean), mask)


def remax_advantages(
    scores: torch.Tensor, group_index: GroupIndex, response_mask: torch.Tensor, reward_baselines: torch.Tensor
) -> torch.Tensor:
    """ReMax: score minus reward_baselines (B,), the score of a greedy response to the same prompt (generated
    with the group and not trained on). verl's compute_remax_outcome_advantage (0 at masked positions here)."""
    scores, _, mask = _check_inputs(scores, group_index, response_mask)
    baselines = check_tensor("reward_baselines", reward_baselines).detach().float().to(scores.device)
    if baselines.shape != scores.shape:
        raise ShapeMismatchError(
            f"reward_baselines has shape {tuple(baselines.shape)} but scores has shape {tuple(scores.shape)}; "
            "they must be equal"
        )
    if not bool(torch.isfinite(baselines).all()):
        i = int(torch.nonzero(~torch.isfinite(baselines))[0])
        raise NonFiniteError(f"reward_baselines is not finite: value {baselines[i].item()} at index {i}")
    return _broadcast(scores - baselines, mask)
