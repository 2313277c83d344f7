"""A rank's part of a checkpoint: its shards of the model, the optimizer and the KL reference, through DCP.

save_sharded: every rank writes its own shards (a __<rank>_0.distcp file each) and rank 0 the .metadata
(torch.distributed.checkpoint; never a gathered torch.save of a sharded model). load_sharded: every rank
reads the pieces its shards need, so a checkpoint written at world size N loads at any world size (DCP
reshards), and a plain (unsharded) actor takes the same path without a process group. The directory the
files go to and its manifest are the driver's business (dppo.checkpoint.store, dppo.checkpoint.run).

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
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from dppo.checkpoint.shards import dcp_errors, safe_reader_classes, single_process_is_intended
from dppo.models import tied_aliases, with_aliases
from dppo.workers.actor.fsdp import local_tensor

LR_STEP_KEY = "lr_step"  # the lr schedule's optimizer steps taken (dppo.workers.actor.lr_schedule)


def _state_dict(model, optimizer, ref_model) -> dict:
    """The rank's state as DCP sees it: FQN-keyed (DTensor shards under FSDP2, plain tensors otherwise); a tied weight
    (lm_head.weight = embed_tokens.weight) once, under its first name: DCP would write it twice."""
    state = {"model": _untied(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    if ref_model is not None:
        state["ref_model"] = _untied(ref_model)
    return state


def _untied(model) -> dict:
    aliases = tied_aliases(model)
    return {name: t for name, t in get_model_state_dict(model).items() if name not in aliases}


def _set_model(model, loaded: dict) -> None:
    """Load a model's state read by DCP (its tied weights once) into model, every alias given its tensor."""
    set_model_state_dict(model, with_aliases(loaded, tied_aliases(model)))


def _like_parameters(model, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors keyed like model's parameters, holding `local` (a sharded model's local shards, else whole tensors),
    laid out as the parameters are (DTensors of the same mesh and placements under FSDP2): what DCP reshards."""
    out = {}
    for name, p in model.named_parameters():
        t = local[name]
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
) -> None:
    """Write this rank's shards into the DCP checkpoint directory path (every rank calls it at once); anchor: the
    rank's part of other weights for model (pi_old's, mid-cycle), saved under "anchor" with the same layout;
    lr_step: the lr schedule's optimizer steps taken, under LR_STEP_KEY (the same on every rank)."""
    state = _state_dict(model, optimizer, ref_model)
    if lr_step is not None:
        state[LR_STEP_KEY] = int(lr_step)
    if anchor is not None:
        device = next(model.parameters()).device
        state["anchor"] = _like_parameters(model, {k: v.to(device) for k, v in anchor.items()})
    with single_process_is_intended(), dcp_errors("writing the checkpoint", path):
        dcp.save(state, storage_writer=FileSystemWriter(str(path), sync_files=True))


def load_sharded(path: str | Path, model, optimizer, ref_model=None, anchor: bool = False) -> dict | None:
    """Load the DCP checkpoint at path into this rank's shards, whatever world size wrote it; with anchor, also the
    weights save_sharded kept under "anchor", returned as this rank's part of them (CPU tensors)."""
    reader_cls, planner_cls = safe_reader_classes()
    reader_cls(str(path)).read_metadata()  # UnsafeCheckpointError here, before DCP (which would retry elsewhere)
    state = _state_dict(model, optimizer, ref_model)  # the layout to fill; also creates the optimizer's state
    if anchor:
        empty = {name: torch.empty_like(local_tensor(p)) for name, p in model.named_parameters()}
        state["anchor"] = _like_parameters(model, empty)
    with single_process_is_intended(), dcp_errors("reading the checkpoint", path):
        dcp.load(state, storage_reader=reader_cls(str(path)), planner=planner_cls())
    _set_model(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    if ref_model is not None:
        _set_model(ref_model, state["ref_model"])
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
