"""Rank 0's side of rollout.weight_sync=delta: publish, next to the full weights, what changed since the last publish.

The weights published last are what a rollout engine holds after loading them (and pi_old of the cycle that
follows). They are still in Ray's object store (the replay buffer holds their reference until this publish
replaces it), so the publisher keeps no copy of its own: it keeps the ObjectRef, reads the weights back for the
comparison and drops them again (a transient copy while publishing, not a persistent second one), compares each
tensor in the engine's dtype with the new weights, and puts only the changed elements (dppo.workers.weight_delta)
into the object store. A worker whose engine holds the last publish reads the delta alone; any other reads the full
weights, which are still published every time (the driver's evaluation model, restarted workers).

Every rollout_weights() into the object store goes through the publisher, also a mid-cycle gather for an hf
checkpoint that no worker loads: the next delta then starts from a publish no worker holds, and the workers read
the full weights once (correct, only not smaller).
"""

from __future__ import annotations

from typing import Any

import ray
import torch

from dppo.models import DTYPES
from dppo.workers.weight_delta import PublishedDelta, weight_delta


class DeltaPublisher:
    def __init__(self, dtype: torch.dtype):
        """dtype: the rollout engine's (rollout.dtype, else model.dtype): where values are compared."""
        self.dtype = dtype
        self.last_ref: Any = None  # ObjectRef of the last full publish (None: nothing published yet)

    def publish(self, state: dict[str, torch.Tensor], full_ref: Any) -> list:
        """What the rollout gets: [full_ref], and from the second publish on a PublishedDelta after it. state: the
        weights full_ref holds (this rank's gathered copy, not read back)."""
        published = [full_ref]
        if self.last_ref is not None:
            base = ray.get(self.last_ref)  # the last publish, read back: a transient copy, dropped below
            delta = weight_delta(base, state, self.dtype, self.last_ref.hex(), full_ref.hex())
            del base
            published.append(PublishedDelta(self.last_ref.hex(), ray.put(delta)))
        self.last_ref = full_ref
        return published


def delta_publisher(rollout, model_dtype: str, publish_deltas: bool) -> DeltaPublisher | None:
    """The publisher of the rollout (the config's rollout section) where it syncs deltas, else None. publish_deltas:
    rollout.weight_sync=delta with an engine whose spec accepts deltas, which the driver decides (the rollout side's
    engines are not this side's to import: dppo.workers.rollout.engine_config.publishes_deltas); model_dtype:
    model.dtype (the engine's where rollout.dtype is null)."""
    return DeltaPublisher(DTYPES[rollout.dtype or model_dtype]) if publish_deltas else None
