"""Loss aggregation over valid tokens (verl's loss_agg_mode) with explicit normalizers.

A micro-batch's loss aggregated with the normalizers of its whole mini-batch (LossNormalizers) is exactly its
share of the mini-batch's loss, so the gradients of the micro-batches add up to the mini-batch's gradient.
Every mode divides by one normalizer (or none):

    token-mean               sum over valid tokens / batch_num_tokens
    token-sum                sum over valid tokens
    seq-mean-token-sum       sum over sequences of the token sum / global_batch_size
    seq-mean-token-mean      sum over sequences of the token mean / global_batch_size
    seq-mean-token-sum-norm  seq-mean-token-sum / loss_scale_factor (default T, the padded length; Dr. GRPO)

times dp_size, as verl's agg_loss does: data-parallel training averages gradients over ranks, and the
normalizers count the whole global batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dppo.algo._common import (
    AlgoInputError,
    Checks,
    LossNormalizers,
    Number,
    as_mask,
    check_2d,
    check_loss_scale_factor,
    check_normalizers,
    check_same_shape,
    check_tensor,
    lookup,
    to_floats,
)

__all__ = [
    "LOSS_AGG_MODES",
    "LossNormalizers",
    "agg_divisor",
    "agg_loss",
    "agg_loss_unchecked",
    "check_normalizers",
    "loss_normalizers",
]


def loss_normalizers(mask: torch.Tensor) -> LossNormalizers:
    """The normalizers of a batch whose loss mask is mask (B, T): its valid tokens and non-empty sequences.

    The counts are 0-dim int64 tensors on mask's device (no host sync), so a data-parallel caller can
    all-reduce them before aggregating.
    """
    mask = as_mask("mask", mask)
    check_2d("mask", mask)
    return LossNormalizers(batch_num_tokens=mask.sum(), global_batch_size=mask.any(-1).sum())


@dataclass(frozen=True)
class AggMode:
    """A loss_agg_mode: numerator(x, mask, horizon) over x (B, T), zero at masked positions, divided by a normalizer."""

    numerator: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    normalizer: str | None  # the LossNormalizers field it divides by; None: no division


def _seq_token_means(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each sequence's mean over its valid tokens (B,), 0 for a sequence without any (verl's + 1e-8)."""
    return x.sum(-1) / (mask.sum(-1) + 1e-8)


LOSS_AGG_MODES: dict[str, AggMode] = {
    "token-mean": AggMode(lambda x, mask, horizon: x.sum(), "batch_num_tokens"),
    "token-sum": AggMode(lambda x, mask, horizon: x.sum(), None),
    "seq-mean-token-sum": AggMode(lambda x, mask, horizon: x.sum(-1).sum(), "global_batch_size"),
    "seq-mean-token-mean": AggMode(lambda x, mask, horizon: _seq_token_means(x, mask).sum(), "global_batch_size"),
    "seq-mean-token-sum-norm": AggMode(lambda x, mask, horizon: x.sum(-1).sum() / horizon, "global_batch_size"),
}


def agg_divisor(mode: str, normalizers: LossNormalizers, mask: torch.Tensor) -> torch.Tensor:
    """What mode divides its numerator by (a 0-dim tensor >= 1; 1 for token-sum), before the dp_size factor.

    A None normalizer is mask's own count: its valid tokens, or its sequences with a valid token; with
    dp_size > 1 it must be given (the global count).
    """
    field = lookup(LOSS_AGG_MODES, mode, "loss_agg_mode").normalizer
    if field is None:
        return torch.ones((), device=mask.device)
    value = getattr(normalizers, field)
    if value is None and normalizers.dp_size > 1:
        dp = normalizers.dp_size
        raise AlgoInputError(f"{field} (of the global batch) is required when dp_size > 1; got dp_size={dp}")
    if value is None:
        value = mask.sum() if field == "batch_num_tokens" else mask.any(-1).sum()
    return torch.as_tensor(value, device=mask.device).clamp(min=1)  # no valid token at all: the loss is 0


def agg_loss_unchecked(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    normalizers: LossNormalizers | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """agg_loss without input checks; loss_mat may hold anything at masked positions."""
    normalizers = normalizers or LossNormalizers()
    agg = lookup(LOSS_AGG_MODES, mode, "loss_agg_mode")
    horizon = loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor
    numerator = agg.numerator(torch.where(mask, loss_mat, 0.0), mask, horizon)
    return numerator / agg_divisor(mode, normalizers, mask) * normalizers.dp_size


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    batch_num_tokens: Number | None = None,
    global_batch_size: Number | None = None,
    dp_size: int = 1,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss (B, T) over valid tokens into a 0-dim fp32 tensor, as verl's agg_loss.

    mode is a LOSS_AGG_MODES name (see the module docstring). batch_num_tokens and global_batch_size are the
    normalizers of the whole batch this one is part of; None means this batch's own valid tokens and non-empty
    sequences; they must be given when dp_size > 1 (as verl requires). loss_scale_factor replaces T in
    seq-mean-token-sum-norm. Sequences without valid tokens add nothing; no valid token at all gives 0, and a
    normalizer below 1 counts as 1.
    """
    loss_mat = check_tensor("loss_mat", loss_mat)
    mask = as_mask("mask", mask)
    check_same_shape("mask", mask, loss_mat=loss_mat)
    check_2d("loss_mat", loss_mat)
    normalizers = LossNormalizers(batch_num_tokens, global_batch_size, dp_size)
    check_normalizers(normalizers)
    check_loss_scale_factor(loss_scale_factor)
    checks = Checks(mask, "mask")
    checks.finite("loss_mat", loss_mat)
    loss = agg_loss_unchecked(loss_mat.float(), mask, mode, normalizers, loss_scale_factor)
    to_floats({}, checks)
    return loss
