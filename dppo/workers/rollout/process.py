"""A rollout worker as a plain local process (ray.enabled=false with trainer.mode=separate_async): the worker loop
(buffer_client.run_tickets) over PipeClient, its pipe to the trainer's process, where answer_calls answers it on the
replay buffer's BufferServer. Both ends of the pipe are here.

The trainer starts it with `multiprocessing` (dppo.trainer.rollout.local_source): forked from the trainer before
it builds its rank (no second import of torch and transformers: the worker generates within about a second of
the fork), or spawned afresh when it replaces a worker that died. The protocol over its end of the pipe, all
messages tuples:

    worker -> trainer   (call, *args): a call of the buffer-client protocol (acquire, newer, put) on the trainer's
                        BufferServer, as this worker's holder; answered by what it returns (put: None)
                        ("error", type name, message): then the worker exits with status 1
    trainer -> worker   the answer; where it carries a publish (a Ticket's, newer's), the publish's weights are the
                        SharedLayout of the shared memory that holds them, whose descriptor follows the answer
                        (SCM_RIGHTS): the weights never go through the pipe as bytes

rollout.partial_rollout: besides the pipe, the worker gets `published`, an 8-byte shared counter (a multiprocessing
RawValue) that the trainer sets to each version it publishes. The worker reads it once per decode chunk, and asks
over the pipe (newer) only when it is newer than the version it holds: a look costs one memory read.

The worker exits when the trainer's end of the pipe closes (the trainer stopped or died), and dies with the
trainer's process (PR_SET_PDEATHSIG) if it is killed mid-generation.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import mmap
import os
import signal
from dataclasses import dataclass
from multiprocessing import reduction

import cloudpickle
import torch

from dppo._text import one_line
from dppo.lora import LoraPublish, LoraSpec
from dppo.workers.rollout.buffer_client import BufferClient, run_tickets
from dppo.workers.rollout.buffer_server import WORKER_CALLS, BufferServer
from dppo.workers.rollout.replay_buffer import Finished, Published, Ticket, map_weights, publish_in
from dppo.workers.rollout.worker import StateDictWeights, worker_generator

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


@dataclass(frozen=True)
class LoraLayout:
    """A LoRA publish's place in shared memory (model.lora_rank): the base's SharedLayout (the same memory for the
    whole run) and this version's adapter's, their two descriptors following the answer in that order."""

    base: SharedLayout
    adapter: SharedLayout
    base_id: str
    scaling: float
    spec: LoraSpec


class SharedLora:
    """A LoRA publish for the local workers: the base in one SharedState written once per run (base_memory, handed
    in again at every publish) and the adapter in a small one of its own."""

    def __init__(self, publish: LoraPublish, base_memory: SharedState) -> None:
        self.base, self.adapter = base_memory, SharedState(publish.adapter)
        self.publish = dataclasses.replace(publish, adapter=self.adapter.state_dict())
        self.layout = LoraLayout(self.base.layout, self.adapter.layout, publish.base_id, publish.scaling, publish.spec)
        self.fds = (self.base.fd, self.adapter.fd)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The merged model (what the trainer's published_weights() reads)."""
        return self.publish.state_dict()


def die_with_parent(name: str) -> None:
    """Have the kernel SIGKILL this process when its parent dies, and name it (its comm, what ps and top show; the
    command line stays the trainer's for a forked worker). Linux; a no-op where prctl is missing."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass


class PipeClient(BufferClient):
    """A local worker's calls over its pipe (see the module docstring); published: the trainer's shared counter of its
    newest version (None: no mid-ticket loads)."""

    def __init__(self, conn, published=None) -> None:
        self.conn, self.published = conn, published
        self.looks_mid_ticket = published is not None
        self._lora_base: tuple[str, dict[str, torch.Tensor]] | None = None  # (base id, its mapping): LoRA publishes

    def _call(self, name: str, *args):
        self.conn.send((name, *args))
        # a publish's memory: its descriptor follows on the pipe; mapped here (closed once its tensors are dropped)
        return map_weights(self.conn.recv(), lambda layout: StateDictWeights(self._attach(layout)))

    def _attach(self, layout: SharedLayout | LoraLayout):
        if not isinstance(layout, LoraLayout):
            return SharedState.attach(reduction.recv_handle(self.conn), layout)
        base_fd, adapter_fd = reduction.recv_handle(self.conn), reduction.recv_handle(self.conn)
        if self._lora_base is None or self._lora_base[0] != layout.base_id:  # mapped once per run's base
            self._lora_base = (layout.base_id, SharedState.attach(base_fd, layout.base))
        else:
            os.close(base_fd)
        adapter = SharedState.attach(adapter_fd, layout.adapter)
        return LoraPublish(self._lora_base[1], adapter, layout.scaling, layout.base_id, layout.spec)

    def acquire(self, version: int, num_groups: int) -> Ticket:
        return self._call("acquire", version, num_groups)

    def newer(self, version: int) -> Published | None:
        """The shared counter read; only where it is newer than `version`, the publish asked for over the pipe."""
        if self.published.value <= version:
            return None
        return self._call("newer", version)

    def put(self, finished: Finished) -> None:
        self._call("put", finished.stored())


def answer_calls(conn, buffer: BufferServer, holder: int, pid: int) -> tuple[str, str] | None:
    """The trainer's end of a worker's pipe: answer the worker's calls on buffer, as holder (the worker's process:
    pid), until it reports an error (returned: its type name and message) or the pipe closes (None)."""
    try:
        while True:
            name, *args = conn.recv()
            if name == "error":
                return args[0], args[1]
            if name not in WORKER_CALLS:
                raise ValueError(
                    f"rollout worker (holder {holder}) called {name!r}: expected one of {sorted(WORKER_CALLS)}"
                )
            answer = getattr(buffer, name)(*args, holder=holder)
            publish = publish_in(answer)  # its weights a SharedState: the layout goes in the answer, the memory apart
            conn.send(map_weights(answer, lambda shared: shared.layout))
            if publish is not None:
                shared = publish.weights
                for fd in shared.fds if isinstance(shared, SharedLora) else (shared.fd,):  # LoRA: base, adapter
                    reduction.send_handle(conn, fd, pid)
    except (EOFError, OSError):
        return None  # the worker exited (or was killed), or the trainer closed the pipe


def main(conn, payload: bytes, worker_index: int, parent_pid: int, published=None) -> None:
    """The worker process's main: payload is cloudpickle.dumps((settings, source, model_config)): the driver's
    RolloutWorkerSettings of the run, and the trainer's PromptSource object itself (a worker must not rebuild it: a register_task task exists in the trainer only);
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
        settings, source, model_config = cloudpickle.loads(payload)
        generator = worker_generator(settings, source, model_config, worker_index, "cpu")
        run_tickets(PipeClient(conn, published), generator, settings.groups_per_batch)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the trainer closed its end or is gone: nothing to report to
    except BaseException as err:  # noqa: BLE001  reported to the trainer, which raises it as the rollout's failure
        try:
            conn.send(("error", type(err).__name__, one_line(err)))
        except OSError:
            pass
        raise SystemExit(1) from None
