"""The actor's shards on disk: a DCP (torch.distributed.checkpoint) directory, read without running code from it.

DCP's FileSystemReader unpickles .metadata with pickle.load and non-tensor values with torch.load(weights_only=False);
safe_reader_classes' SafeReader unpickles .metadata with an allow-list of DCP's own metadata types, and its
SafeLoadPlanner loads non-tensor values with weights_only=True. Anything else is an UnsafeCheckpointError before any
of it is used. DCP's failures become one ShardedCheckpointError naming each rank's error (dcp_errors).

The ranks write and read their own shards with these (dppo.workers.actor.sharded_state); load_full_weights reads a
checkpoint's weights whole with no rank at all (dppo export and dppo eval, dppo.checkpoint.export).
"""

from __future__ import annotations

import contextlib
import io
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

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


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint's metadata or values need a Python global outside the allow-list (they could run code)."""


class ShardedCheckpointError(RuntimeError):
    """DCP could not save or load a checkpoint; names each failing rank's first error (not DCP's traceback dump)."""


@contextlib.contextmanager
def dcp_errors(what: str, path: str | Path):
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


def safe_reader_classes():
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


@contextlib.contextmanager
def single_process_is_intended():
    """DCP warns whenever it runs without a process group; a plain one-rank actor means to."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def load_full_weights(path: str | Path, key: str = "model") -> dict[str, torch.Tensor]:
    """The whole model's weights as plain CPU tensors (a state dict for model.load_state_dict) from the DCP
    checkpoint at path, whatever world size wrote it; no process group, model or rank needed. key: "model", or
    "ref_model" (the KL reference) or "anchor" (pi_old of a mid-cycle checkpoint) where the checkpoint has them."""
    reader_cls, planner_cls = safe_reader_classes()
    metadata = reader_cls(str(path)).read_metadata()
    prefix = key + "."
    state = {
        fqn: torch.empty(md.size, dtype=md.properties.dtype)
        for fqn, md in metadata.state_dict_metadata.items()
        if fqn.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }
    if not state:
        raise ShardedCheckpointError(f"the checkpoint {str(path)!r} holds no {key!r} weights")
    with single_process_is_intended(), dcp_errors("reading the checkpoint", path):
        dcp.load(state, storage_reader=reader_cls(str(path)), planner=planner_cls(), no_dist=True)
    return {fqn[len(prefix) :]: t for fqn, t in state.items()}
