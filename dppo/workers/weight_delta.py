"""A weight delta (rollout.weight_sync=delta): the engine-dtype elements that changed between two published versions.

The trainer's rank 0 computes it (dppo.workers.actor.publish_delta) against the weights it published last, which
are what a rollout engine holds after loading them; a rollout worker whose engine holds exactly that base applies
it in place (dppo.workers.rollout.engines) instead of reading the full weights. Shared by both sides (neither
imports the other), so it lives here.

A tensor's update is its changed elements' flat indices and new values, or the whole tensor (index None) where
that is smaller; an unchanged tensor has none. "Changed" is bitwise in the engine dtype, so -0.0 vs 0.0 and NaNs
count: a base updated with the delta equals the new weights rounded to the engine dtype, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

_INT32_MAX = 2**31 - 1


@dataclass
class TensorDelta:
    index: torch.Tensor | None  # (k,) int32 (int64 for tensors of 2**31 elements or more) flat indices; None: dense
    values: torch.Tensor  # (k,) engine dtype; with index None the whole tensor (its shape)
    changed: int  # k: elements whose engine-dtype bits changed (also when sent dense)

    @property
    def nbytes(self) -> int:
        index_bytes = 0 if self.index is None else self.index.numel() * self.index.element_size()
        return index_bytes + self.values.numel() * self.values.element_size()


@dataclass
class WeightDelta:
    """What turns the engine-dtype weights of the publish `base` into those of the publish `new`."""

    base: str  # id of the publish the delta starts from (the hex of its full weights' ObjectRef)
    new: str  # id of the publish it leads to
    dtype: torch.dtype  # the engine dtype the comparison was made in
    tensors: dict[str, TensorDelta] = field(default_factory=dict)  # changed tensors only (transformers names)
    changed_elements: int = 0
    total_elements: int = 0

    @property
    def nbytes(self) -> int:
        """The bytes a worker reads: indices and values of the changed tensors."""
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def changed_fraction(self) -> float:
        return self.changed_elements / max(self.total_elements, 1)


@dataclass
class PublishedDelta:
    """The delta half of a delta publish: [full_ref, PublishedDelta] is what the trainer publishes. base tells a
    worker without fetching anything whether the delta applies to the weights its engine holds."""

    base: str
    ref: Any  # ObjectRef of the WeightDelta


def bits(t: torch.Tensor) -> torch.Tensor:
    """t's elements as integers of the same width (flat): equal bits <=> equal integers."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.reshape(-1).view(width)


def tensor_delta(base: torch.Tensor, new: torch.Tensor, dtype: torch.dtype) -> TensorDelta | None:
    """The update that turns base (already in dtype) into new.to(dtype); None where nothing changed. Builds one
    engine-dtype temporary of new (a tensor at a time, never the whole model)."""
    converted = new.detach().to(dtype)
    index = torch.nonzero(bits(converted) != bits(base.detach().to(dtype))).squeeze(1)  # (k,) int64
    k = index.numel()
    if k == 0:
        return None
    sparse_bytes = k * (4 if new.numel() <= _INT32_MAX else 8) + k * converted.element_size()
    if sparse_bytes >= converted.numel() * converted.element_size():
        # a copy where .to() returned the live tensor itself: the delta must not change with later steps
        dense = converted.clone() if converted.data_ptr() == new.data_ptr() else converted.contiguous()
        return TensorDelta(None, dense, k)
    if new.numel() <= _INT32_MAX:
        index = index.to(torch.int32)
    return TensorDelta(index, converted.reshape(-1)[index.long()], k)


def weight_delta(
    base: dict[str, torch.Tensor], new: dict[str, torch.Tensor], dtype: torch.dtype, base_id: str, new_id: str
) -> WeightDelta:
    """The delta of two state dicts of the same tensors (new may be in another dtype than base), compared in dtype."""
    if base.keys() != new.keys():
        raise ValueError(
            f"a weight delta needs the same tensors on both sides; only in the base: "
            f"{sorted(base.keys() - new.keys())[:5]}, only in the new: {sorted(new.keys() - base.keys())[:5]}"
        )
    delta = WeightDelta(base_id, new_id, dtype)
    for name, tensor in new.items():
        delta.total_elements += tensor.numel()
        update = tensor_delta(base[name], tensor, dtype)
        if update is not None:
            delta.tensors[name] = update
            delta.changed_elements += update.changed
    return delta


def apply_delta(weights: dict[str, torch.Tensor], delta: WeightDelta) -> list[str]:
    """Apply delta in place to weights (engine dtype, the base's values); the names of the tensors it changed."""
    for name, update in delta.tensors.items():
        held = weights[name]
        if held.dtype != update.values.dtype:
            raise TypeError(
                f"weight delta of {name} is {update.values.dtype}; the weights it applies to are {held.dtype}"
            )
        if update.index is None:
            held.copy_(update.values)
        else:
            held.view(-1)[update.index.long()] = update.values
    return list(delta.tensors)
