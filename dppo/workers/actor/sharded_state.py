"""A rank's part of a checkpoint: its shards of the model, the optimizer and the KL reference, through DCP.

save_sharded: every rank writes its own shards (a __<rank>_0.distcp file each) and rank 0 the .metadata
(torch.distributed.checkpoint; never a gathered torch.save of a sharded model). load_sharded: every rank
reads the pieces its shards need, so a checkpoint written at world size N loads at any world size (DCP
reshards), and a plain (unsharded) actor takes the same path without a process group. The directory the
files go to and its manifest are the driver's business (dppo.checkpoint.store, dppo.trainer.base).

Loading runs no code from the files. DCP's FileSystemReader unpickles .metadata with pickle.load and
non-tensor values with torch.load(weights_only=False); SafeReader unpickles .metadata with an allow-list of
DCP's own metadata types, and SafeLoadPlanner loads non-tensor values with weights_only=True. Anything else
is an UnsafeCheckpointError before any of it is used.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from dppo.models import tied_aliases, with_aliases
from dppo.workers.actor.fsdp import local_tensor

# (module, name) of every global a .metadata written by DCP refers to; torch dtypes are checked by type.
_METADATA_GLOBALS = {
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
}
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
LR_STEP_KEY = "lr_step"  # the lr schedule's optimizer steps taken (dppo.workers.actor.lr_schedule)


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint's metadata or values need a Python global outside the allow-list (they could run code)."""


class ShardedCheckpointError(RuntimeError):
    """DCP could not save or load a checkpoint; names each failing rank's first error (not DCP's traceback dump)."""


@contextlib.contextmanager
def _dcp_errors(what: str, path: str | Path):
    """DCP's CheckpointException (a BaseException holding every rank's traceback) as one ShardedCheckpointError; an
    interrupt that DCP caught on a rank (Ctrl-C, or dppo.stopping's Stopped in a rank running in the trainer's own
    process) is raised as itself: the run is stopping, not failing to write."""
    try:
        yield
    except CheckpointException as err:
        for exc, _ in err.failures.values():
            if isinstance(exc, KeyboardInterrupt):
                raise exc from None
        failures = "; ".join(
            f"rank {rank}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            for rank, (exc, _) in sorted(err.failures.items())
        )
        raise ShardedCheckpointError(f"{what} {str(path)!r} failed: {failures}") from None


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_GLOBALS or (module == _METADATA_MODULE and not name.startswith("__")):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"checkpoint metadata refers to {module}.{name}, which a DCP checkpoint never holds; refusing to load it"
        )


def _safe_reader_classes():
    """(SafeReader, SafeLoadPlanner): DCP's reader and load planner, with an allow-list for what they unpickle."""

    class SafeReader(FileSystemReader):
        """FileSystemReader whose .metadata is unpickled with an allow-list."""

        def read_metadata(self, *args, **kwargs) -> Metadata:
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if not isinstance(metadata, Metadata):
                raise UnsafeCheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP Metadata")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DefaultLoadPlanner whose non-tensor values load with weights_only=True."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            try:
                loaded = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as err:
                raise UnsafeCheckpointError(f"checkpoint value {read_item.dest_index.fqn!r}: {err}") from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafeReader, SafeLoadPlanner


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


@contextlib.contextmanager
def _single_process_is_intended():
    """DCP warns whenever it runs without a process group; a plain one-rank actor means to."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


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
    with _single_process_is_intended(), _dcp_errors("writing the checkpoint", path):
        dcp.save(state, storage_writer=FileSystemWriter(str(path), sync_files=True))


def load_sharded(path: str | Path, model, optimizer, ref_model=None, anchor: bool = False) -> dict | None:
    """Load the DCP checkpoint at path into this rank's shards, whatever world size wrote it; with anchor, also the
    weights save_sharded kept under "anchor", returned as this rank's part of them (CPU tensors)."""
    reader_cls, planner_cls = _safe_reader_classes()
    reader_cls(str(path)).read_metadata()  # UnsafeCheckpointError here, before DCP (which would retry elsewhere)
    state = _state_dict(model, optimizer, ref_model)  # the layout to fill; also creates the optimizer's state
    if anchor:
        empty = {name: torch.empty_like(local_tensor(p)) for name, p in model.named_parameters()}
        state["anchor"] = _like_parameters(model, empty)
    with _single_process_is_intended(), _dcp_errors("reading the checkpoint", path):
        dcp.load(state, storage_reader=reader_cls(str(path)), planner=planner_cls())
    _set_model(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    if ref_model is not None:
        _set_model(ref_model, state["ref_model"])
    return {name: local_tensor(t).to("cpu") for name, t in state["anchor"].items()} if anchor else None


def load_lr_step(path: str | Path) -> int | None:
    """The lr schedule's step count that save_sharded kept in the DCP checkpoint at path; None if it holds none
    (written before the schedule was checkpointed). Reads that one value, no process group needed."""
    reader_cls, planner_cls = _safe_reader_classes()
    if LR_STEP_KEY not in reader_cls(str(path)).read_metadata().state_dict_metadata:
        return None
    state = {LR_STEP_KEY: 0}
    with _single_process_is_intended(), _dcp_errors("reading the checkpoint", path):
        dcp.load(state, storage_reader=reader_cls(str(path)), planner=planner_cls(), no_dist=True)
    return int(state[LR_STEP_KEY])


def load_full_weights(path: str | Path, key: str = "model") -> dict[str, torch.Tensor]:
    """The whole model's weights as plain CPU tensors (a state dict for model.load_state_dict) from the DCP
    checkpoint at path, whatever world size wrote it; no process group, model or rank needed. key: "model", or
    "ref_model" (the KL reference) or "anchor" (pi_old of a mid-cycle checkpoint) where the checkpoint has them."""
    reader_cls, planner_cls = _safe_reader_classes()
    metadata = reader_cls(str(path)).read_metadata()
    prefix = key + "."
    state = {
        fqn: torch.empty(md.size, dtype=md.properties.dtype)
        for fqn, md in metadata.state_dict_metadata.items()
        if fqn.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }
    if not state:
        raise ShardedCheckpointError(f"the checkpoint {str(path)!r} holds no {key!r} weights")
    with _single_process_is_intended(), _dcp_errors("reading the checkpoint", path):
        dcp.load(state, storage_reader=reader_cls(str(path)), planner=planner_cls(), no_dist=True)
    return {fqn[len(prefix) :]: t for fqn, t in state.items()}
