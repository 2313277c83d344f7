"""A rollout engine's side of a LoRA publish (dppo.lora.LoraPublish): the base once, then the adapter's targets alone.

An engine holds plain (merged) weights under transformers names. The first load of a run, or of a worker that holds
none of this base, hands it the whole merged model; every later one hands it the merged weights of the adapter's
target modules only (load_partial), computed here from the base's tensors in the object store (views, read where
they lie) and the adapter's few tensors: what travels is the adapter. An engine without load_partial gets the whole
merged model every time (correct, only not smaller).

The check of such a load (rollout.verify_sync) is two comparisons, made by the worker (dppo.workers.rollout.worker):
the adapter that arrived against the trainer's fingerprint of the adapter it published (an adapter that was not sent,
or a stale one, is named there: never mistaken for staleness), and everything the engine holds afterwards, read back
from it, against the whole merged model (MergedPrints: the base's prints taken once per base, the targets' at every
load). The whole model, not the targets alone: an engine that reloads a fused layer whole (vLLM's qkv_proj under a
q_proj-only adapter) rewrites tensors that were not sent, and reads back every parameter it has by name, which only
the whole model's shapes map.

The merge is rounded straight to the dtype the engine holds (RolloutEngine.held_dtype: bf16 targets for vLLM in bf16,
not fp32 ones cast afterwards), and the worker lets go of it once the check is done (LoraLoad.release): between loads
a worker holds its engine's weights and nothing of the merge.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dppo.lora import LoraPublish, merged_targets
from dppo.workers.rollout.engines import RolloutEngine, WeightSync
from dppo.workers.sync_check import WeightFingerprint
from dppo.workers.weight_fingerprint import fingerprint


def holds_id(publish: LoraPublish) -> str:
    """The id an engine holds once it has loaded any version of this base's adapter: a later version replaces every
    target, so the base is all that a partial load needs held."""
    return f"{publish.base_id}+lora"


@dataclass
class LoraLoad(WeightSync):
    """A LoRA load's cost, with what the worker's check compares: the adapter that arrived and the merged tensors
    handed to the engine."""

    adapter: dict[str, torch.Tensor] | None = None
    targets: dict[str, torch.Tensor] | None = None  # the merged weights of the adapter's targets (transformers names)
    base: dict[str, torch.Tensor] | None = None  # the base the merge was computed from (transformers names)
    base_id: str | None = None  # LoraPublish.base_id of that base

    def release(self) -> None:
        """Let go of the tensors the check compared (the merge: every target's weight), keeping what the load cost."""
        self.adapter = self.targets = self.base = None


def load_lora(engine: RolloutEngine, publish: LoraPublish, holds: str | None) -> tuple[WeightSync, str]:
    """Load publish into engine, which holds the publish of id `holds`: the adapter's targets alone where it holds this
    base already and takes partial loads, else the whole merged model. (what it cost, the id it holds now)."""
    base = publish.base_state()
    targets = merged_targets(base, publish.adapter, publish.scaling, engine.held_dtype)
    if holds == holds_id(publish) and engine.loads_partial:
        sync = engine.load_partial(targets, base)
        moved = publish.nbytes  # what travelled: the adapter (the base's views are read where they lie)
    else:
        sync = engine.load_weights({**base, **targets})
        moved = sync.bytes
    out = LoraLoad(
        sync.seconds,
        moved,
        sync.changed_fraction,
        adapter=publish.adapter,
        targets=targets,
        base=base,
        base_id=publish.base_id,
    )
    return out, holds_id(publish)


class MergedPrints:
    """The fingerprint of the merged model a LoRA load leaves in an engine: the base's prints, taken once per base
    (it never changes within a run: a checksum of the whole model once, not at every load), with the targets' merged
    weights' prints over them."""

    def __init__(self) -> None:
        self._base: tuple[str, torch.dtype, WeightFingerprint] | None = None  # (base id, dtype, the base's prints)

    def of(self, load: LoraLoad, dtype: torch.dtype) -> WeightFingerprint:
        """The whole merged model's fingerprint in dtype (the engine's)."""
        if self._base is None or self._base[:2] != (load.base_id, dtype):
            self._base = (load.base_id, dtype, fingerprint(load.base, dtype))
        base = self._base[2]
        targets = fingerprint(load.targets, dtype)
        return WeightFingerprint(base.dtype, {**base.tensors, **targets.tensors}, dict(base.aliases))
