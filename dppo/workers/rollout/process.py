"""A rollout worker as a plain local process (ray.enabled=false with trainer.mode=separate_async): the same
RolloutGenerator as the Ray actor's, its replay buffer in the trainer's process at the other end of a pipe.

The trainer starts it with `multiprocessing` (dppo.trainer.rollout.local_source): forked from the trainer before
it builds its rank (no second import of torch and transformers: the worker generates within about a second of
the fork), or spawned afresh when it replaces a worker that died. The protocol over its end of the pipe, all
messages tuples:

    worker -> trainer   ("acquire", version held, groups wanted)   answered by a Ticket (stop=True: exit)
                        ("weights", version held)                   rollout.partial_rollout, mid-ticket: answered by
                                                                    None (nothing newer) or (version, SharedLayout,
                                                                    its fingerprint) followed by the memory's descriptor
                        ("put", [StoredGroup], first, SyncCost | None)   what the metrics get of its load
                        ("error", type name, message)               then the worker exits with status 1
    trainer -> worker   Ticket, its weights (when newer) a SharedLayout, followed by the descriptor of the shared
                        memory that holds them (SCM_RIGHTS): the weights never go through the pipe as bytes

rollout.partial_rollout: besides the pipe, the worker gets `published`, an 8-byte shared counter (a multiprocessing
RawValue) that the trainer sets to each version it publishes. The worker reads it once per decode chunk, and asks
over the pipe ("weights") only when it is newer than the version it holds: a look costs one memory read.

The worker exits when the trainer's end of the pipe closes (the trainer stopped or died), and dies with the
trainer's process (PR_SET_PDEATHSIG) if it is killed mid-generation.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import signal
from dataclasses import dataclass
from functools import partial
from multiprocessing import reduction

import cloudpickle
import torch

from dppo._text import one_line
from dppo.hostmem import bound_retention, keep_freed_host_memory
from dppo.workers.rollout.replay_buffer import StoredGroup
from dppo.workers.rollout.worker import RolloutGenerator, generation_step_bytes

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


_ALIGN = 64  # each tensor's bytes start at a multiple of this


@dataclass(frozen=True)
class SharedLayout:
    """Where each tensor of a SharedState lies in its memory: what a ticket carries in place of the weights (the memory
    itself follows as a file descriptor on the worker's pipe)."""

    nbytes: int
    entries: tuple[tuple[str, str, int, tuple[int, ...]], ...]  # (key, dtype name, byte offset, shape), in order

    def views(self, buffer) -> dict[str, torch.Tensor]:
        """The state dict as tensors over buffer (the memory mapped), keyed and ordered as it was published."""
        out = {}
        for key, dtype_name, offset, shape in self.entries:
            dtype, numel = getattr(torch, dtype_name), math.prod(shape)
            flat = (
                torch.frombuffer(buffer, dtype=dtype, count=numel, offset=offset)
                if numel
                else torch.empty(0, dtype=dtype)
            )
            out[key] = flat.view(shape)
        return out


class SharedState:
    """A copy of a state dict in one anonymous shared-memory file (memfd) for the local rollout workers: the trainer
    writes it once per publish, each worker maps it (the descriptor passed over its pipe: SCM_RIGHTS) and copies it
    into its model. A tied weight is stored once. The kernel frees the memory once the trainer has let go of the
    version and every worker has closed its mapping."""

    def __init__(self, state_dict: dict[str, torch.Tensor]) -> None:
        """A copy of state_dict (CPU tensors; they may be a training model's live ones) in new shared memory."""
        placed: dict[tuple, int] = {}  # (data_ptr, shape, stride, dtype) -> byte offset: an alias is stored once
        entries, nbytes = [], 0
        for key, tensor in state_dict.items():
            ident = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
            if ident not in placed:
                placed[ident] = nbytes
                nbytes += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
            entries.append((key, str(tensor.dtype).removeprefix("torch."), placed[ident], tuple(tensor.shape)))
        self.layout = SharedLayout(nbytes, tuple(entries))
        self.fd = os.memfd_create("dppo-rollout-weights", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, max(nbytes, 1))
        self._buffer = mmap.mmap(self.fd, max(nbytes, 1))
        for (key, *_), view in zip(entries, self.layout.views(self._buffer).values()):
            view.copy_(state_dict[key].detach())  # an alias is written twice to the same place: harmless

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Views of this process's mapping (the trainer's: tests read the published weights back with it)."""
        return self.layout.views(self._buffer)

    def __del__(self) -> None:
        try:
            os.close(self.fd)
        except (AttributeError, OSError):
            pass

    @staticmethod
    def attach(fd: int, layout: SharedLayout) -> dict[str, torch.Tensor]:
        """In a worker: the state dict over the memory of descriptor fd, which this closes (the mapping stays while
        the tensors live)."""
        try:
            buffer = mmap.mmap(fd, max(layout.nbytes, 1))
        finally:
            os.close(fd)
        return layout.views(buffer)


def die_with_parent(name: str) -> None:
    """Have the kernel SIGKILL this process when its parent dies, and name it (its comm, what ps and top show; the
    command line stays the trainer's for a forked worker). Linux; a no-op where prctl is missing."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _refresh(conn, core: RolloutGenerator, published, syncs: list):
    """rollout.partial_rollout's look for newer weights, once per decode chunk: the shared counter read; where it is
    newer than the weights held, the trainer asked for them over the pipe. A loader of them, or None."""
    if published.value <= core.version:
        return None
    conn.send(("weights", core.version))
    answer = conn.recv()
    if answer is None:
        return None
    version, layout, fingerprint = answer
    state = SharedState.attach(reduction.recv_handle(conn), layout)

    def load() -> int:
        syncs[0] = core.load_weights(state, version, fingerprint)
        return version

    return load


def serve(conn, payload: bytes, worker_index: int, parent_pid: int, published=None) -> None:
    """The worker process's main: payload is cloudpickle.dumps((cfg, source, model_config)), the trainer's
    PromptSource object itself (a worker must not rebuild it: a register_task task exists in the trainer only);
    parent_pid: the trainer's process; published: the trainer's shared counter of its newest version (None: no
    mid-ticket loads)."""
    die_with_parent(f"dppo-rollout-{worker_index}")
    if os.getppid() != parent_pid:
        return  # the trainer died before the death signal was armed
    # A forked worker has the trainer's signal handling: Ctrl-C is the trainer's to handle (it stops the workers),
    # SIGTERM ends the worker, and no signal of the worker's may reach the trainer's wakeup pipe (dppo.stopping).
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        cfg, source, model_config = cloudpickle.loads(payload)
        keep_freed_host_memory()
        torch.set_num_threads(cfg.rollout.num_threads)
        core = RolloutGenerator(cfg, source, model_config, worker_index, "cpu")
        bound_retention(generation_step_bytes(cfg.rollout, cfg.actor.micro_batch_size, model_config.vocab_size))
        while True:
            conn.send(("acquire", core.version, cfg.rollout.groups_per_batch))
            ticket = conn.recv()
            if ticket.stop:
                return
            syncs = [None]  # the ticket's latest weight load
            if ticket.weights is not None:  # a SharedLayout; the memory's descriptor follows on the pipe
                syncs[0] = core.load_weights(
                    SharedState.attach(reduction.recv_handle(conn), ticket.weights), ticket.version, ticket.fingerprint
                )
            core.seed_ticket(ticket.first)
            refresh = None if published is None else partial(_refresh, conn, core, published, syncs)
            groups = core.generate(ticket.num_groups, refresh)
            conn.send(("put", [StoredGroup.of(g) for g in groups], ticket.first, syncs[0]))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the trainer closed its end or is gone: nothing to report to
    except BaseException as err:  # noqa: BLE001  reported to the trainer, which raises it as the rollout's failure
        try:
            conn.send(("error", type(err).__name__, one_line(err)))
        except OSError:
            pass
        raise SystemExit(1) from None
