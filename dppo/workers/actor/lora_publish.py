"""Rank 0's side of a LoRA policy's publishes (model.lora_rank; dppo.lora.LoraPublish)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dppo.lora import LoraPublish, LoraSpec, plain_name, split_state
from dppo.models import SharedWeights, retied


class LoraPublisher:
    """Rank 0's side of a LoRA policy's publishes: the base put into the object store at the first publish (its
    ObjectRef then travels inside every LoraPublish), the adapter copied every time."""

    def __init__(self, spec: LoraSpec) -> None:
        self.spec = spec
        self.base: Any = None  # ObjectRef of SharedWeights, or the base's CPU tensors outside Ray
        self.base_id: str | None = None

    def publish(
        self, state: Mapping[str, torch.Tensor], aliases: Mapping[str, str], to_object_store: bool
    ) -> LoraPublish:
        """state: the injected model's whole CPU state dict (peft names); aliases: its tied names (tied_aliases)."""
        base, adapter = split_state(state)
        if self.base is None:
            plain_aliases = {plain_name(a): plain_name(n) for a, n in aliases.items()}
            if to_object_store:
                import ray

                self.base = ray.put(SharedWeights.of(base, plain_aliases))
                self.base_id = self.base.hex()
            else:
                # the frozen tensors themselves, no copy (no step, load or pi_old read writes a frozen parameter:
                # they hold only the trainable ones); a tied weight stays one tensor, as the sync check tells ties by it
                self.base = retied(dict(base), plain_aliases)
                self.base_id = f"local-{id(self.base):x}"
        adapter = {name: t.detach().to("cpu", copy=True) for name, t in adapter.items()}
        return LoraPublish(self.base, adapter, self.spec.scaling, self.base_id, self.spec)
