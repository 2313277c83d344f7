"""Input checks, typed errors and one-sync metric extraction shared by the dppo.algo functions."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from dppo.algo_names import UnknownNameError  # defined with the names, torch-free (the config raises it)

# Log-ratios are clamped to this bound before exp (as verl does): exp(20) ~ 4.9e8 stays finite in fp32.
LOG_RATIO_BOUND = 20.0


class AlgoInputError(ValueError):
    """An argument passed to a dppo.algo function has a bad value (a tensor's contents, a coefficient...)."""


class ShapeMismatchError(AlgoInputError):
    """Two tensors that must share a shape do not."""


class NonFiniteError(AlgoInputError):
    """A NaN or inf sits at a position the mask marks as valid."""


def lookup(registry: Mapping[str, Callable], name: str, what: str) -> Callable:
    """Return registry[name], or raise UnknownNameError listing the valid names."""
    try:
        return registry[name]
    except (KeyError, TypeError):
        valid = ", ".join(repr(k) for k in registry)
        raise UnknownNameError(f"unknown {what} {name!r}; valid names: {valid}") from None


def check_tensor(name: str, value: object) -> torch.Tensor:
    """Return value if it is a tensor, else raise TypeError naming the argument."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(value).__name__}")
    return value


def as_mask(name: str, mask: object) -> torch.Tensor:
    """Return a bool view of a mask (bool, or numeric where nonzero means valid)."""
    mask = check_tensor(name, mask)
    return mask if mask.dtype == torch.bool else mask != 0


def check_2d(name: str, t: torch.Tensor) -> None:
    """Raise AlgoInputError naming the shape unless t is (B, T): the seq-level modes read dim -1 as T."""
    if t.dim() != 2:
        raise AlgoInputError(f"{name} must have shape (B, T); got shape {tuple(t.shape)}")


def check_same_shape(ref_name: str, ref: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    """Raise ShapeMismatchError naming both shapes if any tensor's shape differs from ref's."""
    for name, t in tensors.items():
        if t is None:
            continue
        check_tensor(name, t)
        if t.shape != ref.shape:
            raise ShapeMismatchError(
                f"{name} has shape {tuple(t.shape)} but {ref_name} has shape {tuple(ref.shape)}; they must be equal"
            )


def check_number(name: str, value: object, *, minimum: float | None = None, above: float | None = None) -> float:
    """Return value if it is a finite int/float (not a bool), >= minimum and > above where given; else raise
    AlgoInputError naming the argument and the value."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok:
        raise AlgoInputError(f"{name} must be a finite number; got {value!r}")
    if minimum is not None and value < minimum:
        raise AlgoInputError(f"{name} must be >= {minimum}; got {value!r}")
    if above is not None and value <= above:
        raise AlgoInputError(f"{name} must be > {above}; got {value!r}")
    return value


Number = int | float | torch.Tensor


@dataclass(frozen=True)
class LossNormalizers:
    """The denominators of agg_loss for a whole (mini-)batch, verl's names; None: the aggregated batch's own count."""

    batch_num_tokens: Number | None = None
    """Valid tokens of the whole batch (token-mean)."""

    global_batch_size: Number | None = None
    """Sequences of the whole batch with at least one valid token (the seq-mean-* modes)."""

    dp_size: int = 1
    """Data-parallel ranks whose gradients are averaged; the two counts above then cover all ranks."""


def check_normalizers(normalizers: object) -> None:
    """Raise TypeError / AlgoInputError naming the value unless normalizers is None or a valid LossNormalizers."""
    if normalizers is None:
        return
    if not isinstance(normalizers, LossNormalizers):
        raise TypeError(f"normalizers must be a LossNormalizers or None; got {type(normalizers).__name__}")
    dp = normalizers.dp_size
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise AlgoInputError(f"dp_size must be an int >= 1; got {dp!r}")
    for name in ("batch_num_tokens", "global_batch_size"):
        value = getattr(normalizers, name)
        if isinstance(value, bool) or (value is not None and not isinstance(value, (int, float, torch.Tensor))):
            raise TypeError(f"{name} must be a number, a 0-dim tensor or None; got {value!r}")


def check_loss_scale_factor(value: object) -> None:
    """Raise AlgoInputError naming the value unless it is None or a finite number > 0."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0
    if value is not None and not ok:
        raise AlgoInputError(f"loss_scale_factor must be a finite number > 0 or None; got {value!r}")


class Checks:
    """Deferred value checks whose flags travel in the same device->host copy as the metrics."""

    def __init__(self, mask: torch.Tensor | None, mask_name: str = "response_mask"):
        self.mask = mask  # None: every position is valid
        self.mask_name = mask_name
        # (error type, message, bad positions (B, T), the checked values (B, T))
        self._items: list[tuple[type[AlgoInputError], str, torch.Tensor, torch.Tensor]] = []

    def finite(self, name: str, t: torch.Tensor) -> None:
        """Flag NaN/inf in t at positions where the mask is valid."""
        t = t.detach()
        self._items.append((NonFiniteError, f"{name} is not finite", self._valid(~torch.isfinite(t)), t))

    def nonnegative(self, name: str, t: torch.Tensor) -> None:
        """Flag negative values in t at positions where the mask is valid."""
        t = t.detach()
        self._items.append((AlgoInputError, f"{name} is negative", self._valid(t < 0), t))

    def _valid(self, bad: torch.Tensor) -> torch.Tensor:
        return bad if self.mask is None else bad & self.mask

    def flags(self) -> list[torch.Tensor]:
        """One 0-dim tensor per check: nonzero when the check failed."""
        return [bad.any() for _, _, bad, _ in self._items]

    def raise_failed(self, flag_values: Sequence[float]) -> None:
        """Raise for the first failed check, naming the argument, the position and the value."""
        for (exc, message, bad, t), flag in zip(self._items, flag_values):
            if not flag:
                continue
            pos = tuple(torch.nonzero(bad)[0].tolist())
            value = t[pos].item()
            where = (
                f"where {self.mask_name} is 1"
                if self.mask is not None
                else f"(no {self.mask_name}: every position is valid)"
            )
            raise exc(f"{message}: value {value} at index {list(pos)} {where}")


def checked_mask(mask_name: str, mask: object, **tensors: torch.Tensor | None) -> torch.Tensor:
    """The bool view of a (B, T) mask (bool, or nonzero = valid), after checking that it is 2-D and that each tensor
    is a tensor of its shape: the first one must be given, the others may be None (absent)."""
    mask = as_mask(mask_name, mask)
    check_2d(mask_name, mask)
    first_name, first = next(iter(tensors.items()))
    check_tensor(first_name, first)
    check_same_shape(mask_name, mask, **tensors)
    return mask


def check_masked_terms(
    mask_name: str, mask: object, normalizers: object = None, **tensors: torch.Tensor | None
) -> tuple[torch.Tensor, Checks]:
    """The checks every loss term over a (B, T) mask shares: checked_mask's, and normalizers are valid. Returns the
    bool mask and a Checks that flags NaN/inf in each tensor where the mask is valid (raised by to_floats, in the
    metrics' device sync)."""
    mask = checked_mask(mask_name, mask, **tensors)
    check_normalizers(normalizers)
    checks = Checks(mask, mask_name)
    for name, t in tensors.items():
        if t is not None:
            checks.finite(name, t)
    return mask, checks


def check_added_term(
    coef: object, response_mask: object, normalizers: object, loss_scale_factor: object, **tensors: torch.Tensor
) -> tuple[torch.Tensor, Checks]:
    """The checks of a coef-weighted term added to the policy loss and aggregated as it is (kl_loss, entropy_bonus):
    coef a finite number, the first of tensors a tensor (named before any complaint about the mask), then
    check_masked_terms over response_mask with normalizers, then loss_scale_factor. Returns check_masked_terms'."""
    check_number("coef", coef)
    first_name, first = next(iter(tensors.items()))
    check_tensor(first_name, first)
    mask, checks = check_masked_terms("response_mask", response_mask, normalizers, **tensors)
    check_loss_scale_factor(loss_scale_factor)
    return mask, checks


def to_floats(metrics: Mapping[str, torch.Tensor], checks: Checks | None = None) -> dict[str, float]:
    """Copy 0-dim metric tensors (and check flags) to python floats in one device sync; raise on a failed check."""
    values = [v.detach().float().reshape(()) for v in metrics.values()]
    flags = [f.float() for f in checks.flags()] if checks is not None else []
    if not values and not flags:
        return {}
    host = torch.stack(values + flags).tolist()
    if checks is not None:
        checks.raise_failed(host[len(values) :])
    return dict(zip(metrics.keys(), host[: len(values)]))


def masked_log_ratio(log_prob: torch.Tensor, base_log_prob: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """clamp(log_prob - base_log_prob, -20, 20) in fp32 (B, T), differentiable in log_prob only.

    Both inputs are zeroed where mask is 0 before the subtraction, so whatever those positions hold
    (NaN, inf) gives log ratio 0 there and never reaches a result or a gradient.
    """
    logp, base_logp = log_prob.float(), base_log_prob.detach().float()
    if mask is not None:
        logp, base_logp = torch.where(mask, logp, 0.0), torch.where(mask, base_logp, 0.0)
    return (logp - base_logp).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def unclamped_log_ratio(log_prob: torch.Tensor, base_log_prob: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """log_prob - base_log_prob in fp32 (B, T) as it is (the losses that never exponentiate it, or exponentiate it
    unclamped as verl does; the KL estimators), 0 where mask is 0 whatever is there (None: every position is valid);
    differentiable in log_prob only."""
    logp, base_logp = log_prob.float(), base_log_prob.detach().float()
    if mask is not None:
        logp, base_logp = torch.where(mask, logp, 0.0), torch.where(mask, base_logp, 0.0)
    return logp - base_logp


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over valid positions (0 when there are none); x must already be 0 where mask is 0."""
    return x.sum() / mask.sum().clamp(min=1)


def masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max of x over valid positions (0 when there are none)."""
    m = torch.where(mask, x, float("-inf")).amax() if x.numel() else x.new_zeros(())
    return torch.where(mask.any(), m, 0.0)


def masked_min(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Min of x over valid positions (0 when there are none)."""
    m = torch.where(mask, x, float("inf")).amin() if x.numel() else x.new_zeros(())
    return torch.where(mask.any(), m, 0.0)
