"""Delta weight sync (rollout.weight_sync=delta): only the engine-dtype elements that changed since the last sync.

The weights published at the last sync are the engine's current weights (and pi_old of the cycle after it), so
a sync needs only the elements whose value in the engine's dtype differs from them: with a bf16 engine and an
fp32 trainer most small updates round away. DeltaTracker holds that last engine-dtype copy (transformers
names); apply() finds the changed elements of each tensor (bitwise, so -0.0 vs 0.0 and NaNs count as
changes), puts them into the copy, and reports the bytes a sparse transfer of them takes: per tensor the
smaller of (int32 index + value per changed element) and the dense tensor, 0 for an unchanged one. The copy
then equals new.to(dtype) bitwise. Tied tensors (a tied embedding and lm_head: one tensor under two names) are held
once and compared once.

A worker whose engine holds exactly the weights of the trainer's last publish gets the delta computed on the
trainer (dppo.workers.weight_delta.WeightDelta) instead of the full weights: apply_published() puts it into the
copy. The full-weights path above remains for the first load, a restarted worker and one that skipped a version.

Engines whose layers fuse several checkpoint tensors (vLLM's qkv_proj of q/k/v_proj, a MoE layer's stacked experts)
reload whole layers: reload_groups() widens the changed names to every tensor of the fused layers they belong to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dppo.workers.weight_delta import WeightDelta, apply_delta, bits

_INDEX_BYTES = 4  # int32 element index of a sparse update


@dataclass
class DeltaUpdate:
    changed_names: list[str]  # tensors with at least one changed element
    bytes: int  # what a sparse transfer of the changed elements takes (first sync: all tensors, dense)
    changed_fraction: float  # changed elements / all elements


def tied_aliases(state_dict: dict[str, torch.Tensor]) -> dict[str, str]:
    """name -> the earlier name whose tensor it is (the same memory, shape and strides): a tied embedding's lm_head."""
    owners: dict[tuple, str] = {}
    aliases = {}
    for name, t in state_dict.items():
        key = (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
        if key in owners:
            aliases[name] = owners[key]
        else:
            owners[key] = name
    return aliases


class DeltaTracker:
    def __init__(self):
        self.weights: dict[str, torch.Tensor] = {}  # name -> the engine's current weights (engine dtype)
        self.aliases: dict[str, str] = {}  # tied names -> the name whose held tensor they share (one copy)

    def apply(self, state_dict: dict[str, torch.Tensor], dtype: torch.dtype) -> DeltaUpdate:
        if not self.weights or self.weights.keys() != state_dict.keys():  # first sync (or a new model): all of it
            self.aliases = tied_aliases(state_dict)
            self.weights = {}
            for name, t in state_dict.items():
                owner = self.aliases.get(name)
                self.weights[name] = self.weights[owner] if owner else t.detach().to(dtype).clone()
            dense = sum(t.numel() * t.element_size() for name, t in self.weights.items() if name not in self.aliases)
            return DeltaUpdate(list(self.weights), dense, 1.0)
        changed_names, moved, changed, total = [], 0, 0, 0
        for name, new in state_dict.items():
            if name in self.aliases:
                continue  # its owner's tensor, compared and updated once (reloaded with it, below)
            held = self.weights[name]
            new = new.detach().to(dtype)
            index = torch.nonzero(bits(new) != bits(held)).squeeze(1)  # (k,) changed elements
            total += held.numel()
            if index.numel() == 0:
                continue
            held.view(-1)[index] = new.reshape(-1)[index]  # the sparse update, applied
            changed_names.append(name)
            changed += index.numel()
            moved += min(index.numel() * (_INDEX_BYTES + held.element_size()), held.numel() * held.element_size())
        changed_names += [alias for alias, owner in self.aliases.items() if owner in changed_names]
        return DeltaUpdate(changed_names, moved, changed / max(total, 1))

    def apply_published(self, delta: WeightDelta) -> DeltaUpdate:
        """Apply a delta the trainer computed against the weights held here; bytes: the delta's own (what was read)."""
        if delta.dtype != self._dtype():
            raise TypeError(f"weight delta computed in {delta.dtype}, but the engine's weights are {self._dtype()}")
        return DeltaUpdate(apply_delta(self.weights, delta), delta.nbytes, delta.changed_fraction)

    def _dtype(self) -> torch.dtype | None:
        return next(iter(self.weights.values())).dtype if self.weights else None


# Modules whose parameters an engine fuses in ways packed_modules_mapping does not describe: vLLM stacks every expert
# of a MoE layer into one layer's w13_weight and w2_weight, whatever the checkpoint names them (stacked
# experts.gate_up_proj/down_proj in transformers 5, experts.<i>.gate_proj.weight ... before). A layer that gets only
# some of its tensors is rebuilt from uninitialized memory for the rest, so a change anywhere under such a module
# reloads all of it (a conservative fallback: the whole module, never a part).
WHOLE_MODULES = frozenset({"experts"})


def reload_groups(
    weights: dict[str, torch.Tensor], changed_names: list[str], packed_modules: dict[str, list[str]]
) -> dict[str, torch.Tensor]:
    """The tensors of weights to hand an engine so that every fused layer with a changed tensor gets all of its
    tensors. packed_modules: fused module -> the checkpoint modules it stacks (vLLM's packed_modules_mapping),
    e.g. {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}; a module named in WHOLE_MODULES is one group, all of it."""
    fused_of = {part: fused for fused, parts in packed_modules.items() for part in parts}

    def group(name: str) -> str:
        parts = name.split(".")
        whole = [i for i, part in enumerate(parts[:-1]) if part in WHOLE_MODULES]
        if whole:
            return ".".join(parts[: whole[0] + 1])
        module, _, _param = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        return f"{parent}.{fused_of[leaf]}" if leaf in fused_of else module

    wanted = {group(name) for name in changed_names}
    return {name: t for name, t in weights.items() if group(name) in wanted}
