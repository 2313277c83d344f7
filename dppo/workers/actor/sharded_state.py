"""A rank's part of a checkpoint: its shards of the model, the optimizer and the KL reference, through DCP.

save_sharded: every rank writes its own shards (a __<rank>_0.distcp file each) and rank 0 the .metadata
(torch.distributed.checkpoint; never a gathered torch.save of a sharded model). load_sharded: every rank
reads the pieces its shards need, so a checkpoint written at world size N loads at any world size (DCP
reshards), and a plain (unsharded) actor takes the same path without a process group. The directory the
files go to and its manifest are the driver's business (dppo.checkpoint.store, dppo.checkpoint.run).

A LoRA run (adapter_only) keeps the adapters alone of the model and of the KL reference (dppo.lora.is_adapter): the
frozen base is rebuilt from model.path or trainer.seed as at the start of the run, and the checkpoint records its
hash instead (dppo.checkpoint.lora_base), so that a checkpoint is the adapter's size, not the model's.

Loading runs no code from the files: the shards are read through dppo.checkpoint.shards' allow-listed reader and
planner (UnsafeCheckpointError otherwise), and DCP's failures are its ShardedCheckpointError.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from dppo.checkpoint.shards import dcp_errors, safe_reader_classes, single_process_is_intended
from dppo.lora import is_adapter
from dppo.models import tied_aliases, with_aliases
from dppo.workers.actor.fsdp import local_tensor
from dppo.workers.actor.pi_old_sources import trainable_parameters

LR_STEP_KEY = "lr_step"  # the lr schedule's optimizer steps taken (dppo.workers.actor.lr_schedule)


def _state_dict(model, optimizer, ref_model, adapter_only: bool = False) -> dict:
    """The rank's state as DCP sees it: FQN-keyed (DTensor shards under FSDP2, plain tensors otherwise); a tied weight
    (lm_head.weight = embed_tokens.weight) once, under its first name: DCP would write it twice. adapter_only (LoRA):
    of the model and the reference, the adapter's tensors alone (the optimizer's state is the adapter's anyway)."""
    state = {"model": _untied(model, adapter_only), "optimizer": get_optimizer_state_dict(model, optimizer)}
    if ref_model is not None:
        state["ref_model"] = _untied(ref_model, adapter_only)
    return state


def _untied(model, adapter_only: bool) -> dict:
    aliases = tied_aliases(model)
    return {
        name: t
        for name, t in get_model_state_dict(model).items()
        if name not in aliases and (not adapter_only or is_adapter(name))
    }


def _set_model(model, loaded: dict, adapter_only: bool) -> None:
    """Load a model's state read by DCP (its tied weights once) into model, every alias given its tensor; adapter_only:
    the adapter's tensors, the frozen base left as it was built."""
    options = StateDictOptions(strict=not adapter_only)
    set_model_state_dict(model, with_aliases(loaded, tied_aliases(model)), options=options)


def _like_parameters(model, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors keyed like model's parameters, holding `local` (a sharded model's local shards, else whole tensors)
    for the parameters it names, laid out as those are (DTensors of the same mesh and placements under FSDP2): what
    DCP reshards."""
    params = dict(model.named_parameters())
    out = {}
    for name, t in local.items():
        p = params[name]
        out[name] = (
            DTensor.from_local(t, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            if isinstance(p, DTensor)
            else t
        )
    return out


def save_sharded(
    path: str | Path,
    model,
    optimizer,
    ref_model=None,
    anchor: dict[str, torch.Tensor] | None = None,
    lr_step: int | None = None,
    adapter_only: bool = False,
) -> None:
    """Write this rank's shards into the DCP checkpoint directory path (every rank calls it at once); anchor: the
    rank's part of other weights for model's trainable parameters (pi_old's, mid-cycle), saved under "anchor" with
    the same layout; lr_step: the lr schedule's optimizer steps taken, under LR_STEP_KEY (the same on every rank);
    adapter_only (LoRA): no tensor of the frozen base (see the module docstring)."""
    state = _state_dict(model, optimizer, ref_model, adapter_only)
    if lr_step is not None:
        state[LR_STEP_KEY] = int(lr_step)
    if anchor is not None:
        device = next(model.parameters()).device
        state["anchor"] = _like_parameters(model, {k: v.to(device) for k, v in anchor.items()})
    with single_process_is_intended(), dcp_errors("writing the checkpoint", path):
        dcp.save(state, storage_writer=FileSystemWriter(str(path), sync_files=True))


def load_sharded(
    path: str | Path, model, optimizer, ref_model=None, anchor: bool = False, adapter_only: bool = False
) -> dict | None:
    """Load the DCP checkpoint at path into this rank's shards, whatever world size wrote it; with anchor, also the
    weights save_sharded kept under "anchor" (the trainable parameters'), returned as this rank's part of them (CPU
    tensors). adapter_only: as save_sharded wrote it (the frozen base stays as built)."""
    reader_cls, planner_cls = safe_reader_classes()
    reader_cls(str(path)).read_metadata()  # UnsafeCheckpointError here, before DCP (which would retry elsewhere)
    state = _state_dict(model, optimizer, ref_model, adapter_only)  # the layout to fill; creates the optimizer's state
    if anchor:  # pi_old's slot holds the trainable parameters only (the adapter's, of LoRA)
        empty = {name: torch.empty_like(local_tensor(p)) for name, p in trainable_parameters(model)}
        state["anchor"] = _like_parameters(model, empty)
    with single_process_is_intended(), dcp_errors("reading the checkpoint", path):
        dcp.load(state, storage_reader=reader_cls(str(path)), planner=planner_cls())
    _set_model(model, state["model"], adapter_only)
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    if ref_model is not None:
        _set_model(ref_model, state["ref_model"], adapter_only)
    return {name: local_tensor(t).to("cpu") for name, t in state["anchor"].items()} if anchor else None


def load_lr_step(path: str | Path) -> int | None:
    """The lr schedule's step count that save_sharded kept in the DCP checkpoint at path; None if it holds none
    (written before the schedule was checkpointed). Reads that one value, no process group needed."""
    reader_cls, planner_cls = safe_reader_classes()
    if LR_STEP_KEY not in reader_cls(str(path)).read_metadata().state_dict_metadata:
        return None
    state = {LR_STEP_KEY: 0}
    with single_process_is_intended(), dcp_errors("reading the checkpoint", path):
        dcp.load(state, storage_reader=reader_cls(str(path)), planner=planner_cls(), no_dist=True)
    return int(state[LR_STEP_KEY])
