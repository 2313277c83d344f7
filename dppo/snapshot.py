"""Weight snapshots of a model, kept in exact-size (pinned, on CUDA) host arenas or on the device.

The public face of the compiled engine in csrc/. A pool records the layout of a module's parameters (or of
a mapping name -> tensor) once; each slot then holds one snapshot of all of them::

    pool = SnapshotPool(model)
    pool.save(0)                  # returns at once; the copy runs in the background
    pool.guard(optimizer)         # optimizer.step() first waits for pending saves (pool.fence())
    ...
    pool.restore(0)               # later work sees slot 0 in the live parameters
    with pool.swapped(0):         # live parameters hold slot 0 inside, and come back on exit
        old_logp = model(batch)
    params = pool.view(0)         # {name: tensor} on the slot's memory, for torch.func.functional_call

Async contract: save() returns before its copy has finished. Anything that WRITES the live tensors after a
save (an optimizer step, a restore) must come after pool.fence() (CUDA: the current stream waits; CPU: the
host waits); pool.guard(optimizer) does it for optimizer steps, and restore()/swapped() do it themselves.
Reading a slot (view, restore, swapped, streamer) waits for that slot's pending save.
"""

from __future__ import annotations

import contextlib
import numbers
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from dppo import _C
from dppo._errors import (
    EmptySlotError,
    LayoutMismatchError,
    SnapshotError,
    SnapshotMemoryError,
    UnknownTensorError,
)

__all__ = [
    "EmptySlotError",
    "LayoutMismatchError",
    "SnapshotError",
    "SnapshotMemoryError",
    "SnapshotPool",
    "Streamer",
    "UnknownTensorError",
]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose bytes a snapshot holds: a DTensor's local shard, else the tensor itself."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def _is_registered(handle: Any) -> bool:
    """Whether the hook of a torch RemovableHandle is still registered (remove() deletes its id)."""
    hooks = handle.hooks_dict_ref()
    return hooks is not None and handle.id in hooks


_SLOT_LIMIT = 2**63  # slots are int64 in the engine


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_slot(slot: Any) -> int:
    if not _is_int(slot):
        raise TypeError(f"slot must be an int, got {type(slot).__name__} {slot!r}")
    slot = int(slot)
    if slot < 0:
        raise ValueError(f"slot must be >= 0, got {slot}")
    if slot >= _SLOT_LIMIT:
        raise ValueError(f"slot must be < 2**63, got {slot}")
    return slot


class SnapshotPool:
    """Slots of weight snapshots of one module (or mapping of tensors), with one recorded layout.

    Args:
        module_or_mapping: an nn.Module (its named parameters, tied ones stored once) or a Mapping
            name -> tensor. All tensors must be on one device (CPU or one CUDA device).
        include_buffers: also snapshot the module's buffers (e.g. BatchNorm running statistics).
        trainable_only: of a module, only the parameters that require grad (LoRA's adapters beside a frozen base:
            the frozen tensors never change, so a slot of the trainable ones is the whole snapshot).
        max_host_bytes: cap on the host memory of all arenas; a save that would need more raises
            SnapshotMemoryError and leaves the pool as it was. None: no cap.
        device_budget_bytes: device memory that slots may use (CUDA pools). A slot whose bytes fit the
            remaining budget lives on the device (device-to-device copies); others on the host.
        checksum: record a checksum of every save and verify it on every read of the slot
            (restore/view/swapped/streamer); a mismatch raises SnapshotError and copies nothing.

    The underscored arguments are tuning and testing knobs (CPU worker threads, CPU copy piece size,
    swapped() chunk size, host-arena pinning chunk size with 0 for the engine's default, an artificial
    delay before every CPU copy task, and the 0-based number of one CPU copy task, counted in the order
    the pool issues them, that raises SnapshotError instead of copying).
    """

    def __init__(
        self,
        module_or_mapping: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        include_buffers: bool = False,
        trainable_only: bool = False,
        max_host_bytes: int | None = None,
        device_budget_bytes: int = 0,
        checksum: bool = False,
        _cpu_threads: int = 0,
        _piece_bytes: int = 4 << 20,
        _swap_chunk_bytes: int = 64 << 20,
        _pin_chunk_bytes: int = 0,
        _copy_delay_s: float = 0.0,
        _fail_copy_task: int = -1,
    ) -> None:
        if max_host_bytes is not None and not _is_int(max_host_bytes):
            raise TypeError(
                f"max_host_bytes must be None or an int, got {type(max_host_bytes).__name__} {max_host_bytes!r}"
            )
        if max_host_bytes is not None and max_host_bytes < 0:
            raise ValueError(f"max_host_bytes must be None or >= 0, got {max_host_bytes!r}")
        if not _is_int(device_budget_bytes):
            raise TypeError(
                f"device_budget_bytes must be an int, got {type(device_budget_bytes).__name__} {device_budget_bytes!r}"
            )
        if device_budget_bytes < 0:
            raise ValueError(f"device_budget_bytes must be >= 0, got {device_budget_bytes!r}")
        if isinstance(module_or_mapping, torch.nn.Module):
            self._module: torch.nn.Module | None = module_or_mapping
            self._mapping: Mapping[str, torch.Tensor] | None = None
        elif isinstance(module_or_mapping, Mapping):
            self._module, self._mapping = None, module_or_mapping
        else:
            raise TypeError(f"expected an nn.Module or a Mapping[str, Tensor], got {type(module_or_mapping).__name__}")
        self._include_buffers = include_buffers
        self._trainable_only = trainable_only
        self._recorded = self._current()
        for name, t in self._recorded:
            if not isinstance(name, str):
                raise TypeError(f"tensor names must be str, got {type(name).__name__} {name!r}")
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"'{name}' is a {type(t).__name__}, expected a torch.Tensor")
        self._core = _C.Pool(
            [name for name, _ in self._recorded],
            [_local(t) for _, t in self._recorded],
            max_host_bytes=-1 if max_host_bytes is None else int(max_host_bytes),
            device_budget_bytes=int(device_budget_bytes),
            checksum=bool(checksum),
            cpu_threads=_cpu_threads,
            piece_bytes=_piece_bytes,
            swap_chunk_bytes=_swap_chunk_bytes,
            pin_chunk_bytes=_pin_chunk_bytes,
            copy_delay_s=_copy_delay_s,
            fail_copy_task=_fail_copy_task,
        )
        self._guards: weakref.WeakKeyDictionary[torch.optim.Optimizer, Any] = weakref.WeakKeyDictionary()

    # ---- layout ------------------------------------------------------------------------------------
    def _current(self) -> list[tuple[str, torch.Tensor]]:
        if self._mapping is not None:
            return list(self._mapping.items())
        assert self._module is not None
        named = list(self._module.named_parameters(remove_duplicate=False))
        if self._trainable_only:
            named = [(name, p) for name, p in named if p.requires_grad]
        if self._include_buffers:
            named += list(self._module.named_buffers(remove_duplicate=False))
        return named

    def _check_layout(self, op: str) -> None:
        """The parameters are the same objects, under the same names, as when the pool was built.

        (Shapes, dtypes, devices and storage of those objects are re-checked in C++.)
        """
        current = self._current()
        if len(current) == len(self._recorded) and all(
            name == rname and t is rt for (name, t), (rname, rt) in zip(current, self._recorded)
        ):
            return
        recorded = dict(self._recorded)
        now = dict(current)
        for name, t in recorded.items():
            if name not in now:
                raise LayoutMismatchError(f"{op}: tensor '{name}' was removed since the pool was built")
            if now[name] is not t:
                raise LayoutMismatchError(
                    f"{op}: tensor '{name}' was replaced since the pool was built (was object {id(t):#x} "
                    f"{tuple(t.shape)} {t.dtype}, now {id(now[name]):#x} {tuple(now[name].shape)} {now[name].dtype})"
                )
        added = [name for name in now if name not in recorded]
        raise LayoutMismatchError(f"{op}: tensors {added} were added since the pool was built")

    # ---- snapshots ---------------------------------------------------------------------------------
    def save(self, slot: int) -> None:
        """Snapshots the live tensors into `slot` (overwriting it). Returns before the copy finishes.

        If the copy fails, the first pool call that sees it (every call that waits for the slot's save, or
        any call made once the copy has ended) raises SnapshotError naming the slot, once. The slot is then
        empty (its bytes were partial), its arena goes back to the free list, and the pool works on.
        """
        slot = _check_slot(slot)
        self._check_layout("save")
        self._core.save(slot)

    def restore(self, slot: int) -> None:
        """Copies `slot` into the live tensors; work queued afterwards (current stream / host) sees it."""
        slot = _check_slot(slot)
        self._check_layout("restore")
        self._core.restore(slot)

    def clear(self, slot: int) -> None:
        """Empties `slot`; its arena goes back to the free list for the next new slot."""
        self._core.clear(_check_slot(slot))

    def fence(self) -> None:
        """Orders later writes of the live tensors after all pending saves (CUDA: current stream waits)."""
        self._core.fence()

    def synchronize(self) -> None:
        """Blocks the host until every copy of this pool has finished."""
        self._core.synchronize()

    def guard(self, optimizer: torch.optim.Optimizer) -> Any:
        """Makes `optimizer.step()` call fence() first, so a step never races a pending save.

        Idempotent per optimizer while its hook is registered: a second call returns the same hook handle.
        After `handle.remove()` the next call registers a new hook (and returns its new handle).
        """
        handle = self._guards.get(optimizer)
        if handle is not None and _is_registered(handle):
            return handle
        pool_ref = weakref.ref(self)

        def _fence_before_step(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
            pool = pool_ref()
            if pool is not None:
                pool.fence()

        handle = optimizer.register_step_pre_hook(_fence_before_step)
        self._guards[optimizer] = handle
        return handle

    @contextlib.contextmanager
    def swapped(self, slot: int) -> Iterator[SnapshotPool]:
        """Inside the block the live tensors hold `slot`; on exit, normal or by exception, they are
        bitwise what they were before. On CUDA the outgoing and incoming copies run at once, chunk by chunk.

        Failures: if entering raises after copies of the slot into the live tensors began (a failed copy or
        CUDA call part way through), the chunks already copied in are copied back from the swap scratch
        before the error propagates, so the live tensors are as they were and the block does not run. If that
        copy back fails too (e.g. a CUDA error that leaves the context unusable), SnapshotError says that the
        live tensors may hold part of the slot. A copy that fails while leaving is not retried: the error
        propagates and the live tensors may hold part of the slot. A failed save that leaving finds (see save())
        is raised once the live tensors are back.
        """
        slot = _check_slot(slot)
        self._check_layout("swapped")
        self._core.swap_in(slot)
        try:
            yield self
        finally:
            self._core.swap_out()

    def view(self, slot: int) -> dict[str, torch.Tensor]:
        """{name: tensor} aliasing the slot's memory (contiguous, original shapes); live tensors untouched.

        For torch.func.functional_call. The views stay valid and unchanged even if the slot is later
        overwritten or cleared (the pool then copies on write); writing through a view changes the slot.

        Lifetime: keep a view alive until every copy or kernel you queued that reads it has completed, e.g.
        the source of your own `dst.copy_(view, non_blocking=True)`: synchronize that stream, or an event
        recorded after the copy, before you drop the last view of the slot. While a view lives, its memory
        is never reused (saves into the slot copy on write). Once the last one is gone the memory is the
        pool's again: a save may overwrite it, ordered only after work already queued on the stream current
        when the save is issued (not after other streams), and release() or dropping the pool may free it
        without waiting for your copy. The views do not come from torch's pinned-memory allocator,
        so torch does not track such copies for them.
        """
        return dict(self._core.view(_check_slot(slot)))

    def streamer(self, slot: int, schedule: Sequence[Sequence[str]]) -> Streamer:
        """A Streamer that hands out `slot`'s tensors step by step (see Streamer)."""
        steps = [[str(name) for name in step] for step in schedule]
        return Streamer(self._core.streamer(_check_slot(slot), steps))

    # ---- verl-style names --------------------------------------------------------------------------
    def save_model_to_cpu(self, slot: int) -> None:
        self.save(slot)

    def restore_model_from_cpu(self, slot: int) -> None:
        self.restore(slot)

    def clear_cpu_model(self, slot: int) -> None:
        self.clear(slot)

    # ---- state -------------------------------------------------------------------------------------
    def __contains__(self, slot: object) -> bool:
        if not _is_int(slot) or not 0 <= int(slot) < _SLOT_LIMIT:
            return False
        return self._core.contains(int(slot))

    def __len__(self) -> int:
        return len(self._core.slots())

    @property
    def slots(self) -> list[int]:
        """Filled slots, sorted."""
        return list(self._core.slots())

    @property
    def names(self) -> list[str]:
        return list(self._core.names())

    def tier(self, slot: int) -> str:
        """'device' or 'host': where the slot's snapshot lives."""
        return self._core.tier(_check_slot(slot))

    @property
    def nbytes(self) -> int:
        """Bytes of one snapshot: the tensors' own bytes (tied tensors once), without padding."""
        return self._core.nbytes

    @property
    def host_bytes(self) -> int:
        """Host bytes held now by all arenas (slots, free list, swap scratch, arenas kept alive by views)."""
        return self._core.host_bytes

    @property
    def device_bytes(self) -> int:
        """Device bytes held now (device-tier slots, device swap scratch, streaming buffers)."""
        return self._core.device_bytes

    def reserve(self, n: int) -> None:
        """Makes at least `n` host arenas free (idle, on the free list), allocating the missing ones now.

        Filled slots do not count: after reserve(n) the next n saves into new slots, or a first swapped()
        block (its swap scratch is a host arena too), allocate nothing. All or nothing: if max_host_bytes or
        the host cannot hold them all, SnapshotMemoryError and no arena is added.
        """
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(f"n must be an int, got {type(n).__name__} {n!r}")
        self._core.reserve(int(n))

    def release(self) -> None:
        """Frees idle memory: free-listed arenas, the swap scratch, the streaming buffers."""
        self._core.release()

    def stats(self) -> dict[str, Any]:
        """Counters of this pool: per op a dict of count, bytes, seconds and gbps, plus memory counters.

        `bytes` are the bytes the engine copied for the op, `seconds` the time those copies ran (not the
        waits before them) and gbps = bytes / seconds. Copies are counted once complete: call synchronize()
        first for exact figures. Per op, with nbytes the bytes of one snapshot (`nbytes`):

        - save: 1 per save(), nbytes (live -> slot).
        - restore: 1 per restore(), nbytes (slot -> live).
        - swap: 1 on entering swapped() and 1 on leaving; 3 x nbytes per block: live -> swap scratch and
          slot -> live on entering, scratch -> live on leaving (the same three transfers that the trainer's
          `moved_bytes` counts for the "swap" reader).
        - view: 1 per view(), counted at the call; 0 bytes, since a view copies nothing; seconds is the time
          spent in view() (waiting for the slot's pending save, making the aliases).
        - stream: 1 per streamer pass (begin()), counted at the call, in every mode. Bytes: what was copied
          into the staging buffers in mode "staged" (each step's tensors, plus the gaps under 4 KiB between
          tensors of a step that are copied with them); 0 in modes "host" and "device", which read the slot
          in place.

        Memory counters: arena_allocs, arena_alloc_bytes, arena_alloc_seconds, arena_frees (host arenas),
        device_allocs, staging_allocs, checksum_seconds, and the current host_bytes, device_bytes, free_arenas,
        retired_storages, pending_copies and slots. failed_copies: copies that failed (each is also raised
        once, see save()); they count in no op above.
        """
        out: dict[str, Any] = {op: dict(v) for op, v in self._core.op_stats().items()}
        for op in out.values():
            op["count"] = int(op["count"])
            op["bytes"] = int(op["bytes"])
        for key, value in self._core.counters().items():
            out[key] = value if key.endswith("seconds") else int(value)
        return out

    def __repr__(self) -> str:
        return (
            f"SnapshotPool({len(self._recorded)} tensors, nbytes={self.nbytes}, slots={self.slots}, "
            f"host_bytes={self.host_bytes}, device_bytes={self.device_bytes})"
        )


class Streamer:
    """Hands out one slot's tensors step by step for a forward pass over the snapshot (issue 5).

    schedule: list of steps, each a list of tensor names (a name may appear in several steps). With CUDA
    live weights and a host slot, each step is copied into one of two device staging buffers on the
    engine's load stream, step i+2 as soon as step i is released, so the copies hide behind the compute.
    Device-tier slots and CPU pools hand out views of the slot itself (no copies).

        with pool.streamer(0, schedule) as st:
            for i in range(st.steps):
                params = st.acquire(i)   # kernels queued after this see step i
                ...                      # run step i with `params`
                st.release(i)            # step i's buffer may be refilled once those kernels ran

    Tensors from acquire(i) are valid until release(i) (staged mode reuses their memory for step i+2).
    """

    def __init__(self, core: Any) -> None:
        self._core = core

    def begin(self) -> None:
        self._core.begin()

    def acquire(self, step: int) -> dict[str, torch.Tensor]:
        return dict(self._core.acquire(_check_step(step)))

    def release(self, step: int) -> None:
        self._core.release(_check_step(step))

    def end(self) -> None:
        self._core.end()

    def __enter__(self) -> Streamer:
        self.begin()
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()

    @property
    def steps(self) -> int:
        return self._core.steps

    @property
    def staging_bytes(self) -> int:
        """Device bytes of the two staging buffers (2 x the largest step, aligned); 0 when zero-copy."""
        return self._core.staging_bytes

    @property
    def mode(self) -> str:
        """'staged' (host slot copied to device buffers), 'device' or 'host' (slot read in place)."""
        return self._core.mode


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step must be an int, got {type(step).__name__} {step!r}")
    return int(step)
