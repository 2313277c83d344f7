"""A rollout engine's side of a LoRA publish (dppo.lora.LoraPublish): the base once, then the adapter's targets alone.

An engine holds plain (merged) weights under transformers names. The first load of a run, or of a worker that holds
none of this base, hands it the whole merged model; every later one hands it the merged weights of the adapter's
target modules only (load_partial), computed here from the base's tensors in the object store (views, read where
they lie) and the adapter's few tensors: what travels is the adapter. An engine without load_partial gets the whole
merged model every time (correct, only not smaller).

The check of such a load (rollout.verify_sync) is two comparisons, made by the worker (dppo.workers.rollout.worker):
the adapter that arrived against the trainer's fingerprint of the adapter it published (an adapter that was not sent,
or a stale one, is named there: never mistaken for staleness), and what the engine holds afterwards, read back from
it, against the merge computed here (LoraLoad.loaded).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dppo.lora import LoraPublish, merged_targets
from dppo.workers.rollout.engines import RolloutEngine, WeightSync


def holds_id(publish: LoraPublish) -> str:
    """The id an engine holds once it has loaded any version of this base's adapter: a later version replaces every
    target, so the base is all that a partial load needs held."""
    return f"{publish.base_id}+lora"


@dataclass
class LoraLoad(WeightSync):
    """A LoRA load's cost, with what the worker's check compares: the adapter that arrived and the merged tensors
    handed to the engine."""

    adapter: dict[str, torch.Tensor] | None = None
    loaded: dict[str, torch.Tensor] | None = None  # the whole merged model on a full load, the targets on a partial one


def load_lora(engine: RolloutEngine, publish: LoraPublish, holds: str | None) -> tuple[WeightSync, str]:
    """Load publish into engine, which holds the publish of id `holds`: the adapter's targets alone where it holds this
    base already and takes partial loads, else the whole merged model. (what it cost, the id it holds now)."""
    base = publish.base_state()
    targets = merged_targets(base, publish.adapter, publish.scaling)
    if holds == holds_id(publish) and engine.loads_partial:
        loaded = targets
        sync = engine.load_partial(targets, base)
        moved = publish.nbytes  # what travelled: the adapter (the base's views are read where they lie)
    else:
        loaded = {**base, **targets}
        sync = engine.load_weights(loaded)
        moved = sync.bytes
    out = LoraLoad(sync.seconds, moved, sync.changed_fraction, adapter=publish.adapter, loaded=loaded)
    return out, holds_id(publish)
