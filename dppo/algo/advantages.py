"""Outcome-reward advantage estimators over prompt groups (GRPO, RLOO), broadcast over response tokens, and the
input checks and group statistics the other estimators (dppo.algo.outcome_advantages) share."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch

from dppo.algo._common import (
    AlgoInputError,
    NonFiniteError,
    ShapeMismatchError,
    as_mask,
    check_tensor,
)


def _group_ids(group_index: torch.Tensor | Sequence[Hashable], device: torch.device) -> torch.Tensor:
    """group_index as an int64 tensor (B,); a sequence of hashables (e.g. uid strings) is numbered in order."""
    if isinstance(group_index, torch.Tensor):
        if group_index.dtype == torch.bool or group_index.is_floating_point() or group_index.is_complex():
            raise TypeError(f"group_index must be an integer tensor; got dtype {group_index.dtype}")
        return group_index.to(device=device, dtype=torch.long)
    numbering: dict[Hashable, int] = {}
    ids = [numbering.setdefault(g, len(numbering)) for g in group_index]
    return torch.tensor(ids, dtype=torch.long, device=device)


def _check_inputs(scores, group_index, response_mask):
    """Validate shapes and values; return scores (B,) fp32, group ids (B,) int64, mask (B, T) bool."""
    scores = check_tensor("scores", scores)
    mask = as_mask("response_mask", response_mask)
    group = _group_ids(group_index, scores.device)
    if scores.dim() != 1:
        raise ShapeMismatchError(f"scores must have shape (B,); got shape {tuple(scores.shape)}")
    if group.shape != scores.shape:
        raise ShapeMismatchError(
            f"group_index has shape {tuple(group.shape)} but scores has shape {tuple(scores.shape)}; they must be equal"
        )
    if mask.dim() != 2 or mask.shape[0] != scores.shape[0]:
        raise ShapeMismatchError(
            f"response_mask has shape {tuple(mask.shape)} but scores has shape {tuple(scores.shape)}; "
            "response_mask must be (B, T) with B = len(scores)"
        )
    scores = scores.detach().float()
    bad = ~torch.isfinite(scores)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise NonFiniteError(f"scores is not finite: value {scores[i].item()} at index {i}")
    return scores, group, mask


def _group_stats(scores: torch.Tensor, group: torch.Tensor):
    """Per-sequence group size, group mean and unbiased group std, each (B,); a group of one has mean 0 and
    std 1 (verl's convention, so its advantage is its score, scaled by 1 / (1 + eps) under GRPO's std)."""
    _, inverse, counts = torch.unique(group, return_inverse=True, return_counts=True)  # (B,), (G,)
    counts_f = counts.to(scores.dtype)
    sums = torch.zeros_like(counts_f).index_add_(0, inverse, scores)  # (G,)
    mean = torch.where(counts > 1, sums / counts_f, 0.0)  # (G,)
    dev = scores - mean[inverse]  # (B,)
    sq = torch.zeros_like(counts_f).index_add_(0, inverse, dev * dev)  # (G,)
    std = torch.where(counts > 1, (sq / (counts_f - 1).clamp(min=1)).sqrt(), 1.0)  # (G,), torch.std's estimator
    return counts[inverse], mean[inverse], std[inverse]


def _broadcast(seq_adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence advantages (B,) -> per-token (B, T), 0 at masked-out positions."""
    return torch.where(mask, seq_adv[:, None], 0.0)


def grpo_advantages(
    scores: torch.Tensor,
    group_index: torch.Tensor | Sequence[Hashable],
    response_mask: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantages (B, T) fp32: (score - group mean) / (group std + eps), 0 at masked tokens; verl's
    compute_grpo_outcome_advantage.

    scores (B,) is the outcome reward of each sequence; group_index (B,) names its prompt group (an integer
    tensor, or any sequence of hashables such as uid strings); the std is unbiased (torch.std). With
    norm_by_std=False the advantage is score - group mean (Dr. GRPO). A group of one has mean 0 and std 1, as
    in verl: its advantage is score / (1 + eps) (score without norm_by_std), not 0.
    """
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps > 0):
        raise AlgoInputError(f"eps must be finite and > 0 (so equal scores do not give 0 / 0); got {eps!r}")
    scores, group, mask = _check_inputs(scores, group_index, response_mask)
    _, mean, std = _group_stats(scores, group)  # (B,) each
    seq_adv = scores - mean
    if norm_by_std:
        seq_adv = seq_adv / (std + eps)
    return _broadcast(seq_adv, mask)


def rloo_advantages(
    scores: torch.Tensor,
    group_index: torch.Tensor | Sequence[Hashable],
    response_mask: torch.Tensor,
) -> torch.Tensor:
    """RLOO advantages (B, T) fp32: score minus the mean score of the other members of its group; verl's
    compute_rloo_outcome_advantage.

    Computed as verl does, n / (n - 1) * score - n / (n - 1) * group mean for a group of n > 1. A group of one
    keeps its score as its advantage (verl's convention), not 0.
    """
    scores, group, mask = _check_inputs(scores, group_index, response_mask)
    size, mean, _ = _group_stats(scores, group)  # (B,) each
    n = size.to(scores.dtype)
    denom = (n - 1).clamp(min=1)
    seq_adv = torch.where(size > 1, scores * n / denom - mean * n / denom, scores)
    return _broadcast(seq_adv, mask)
