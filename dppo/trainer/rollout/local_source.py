"""Separate-async rollout without Ray: rollout workers as local processes, the replay buffer in the trainer's.

ray.enabled=false with trainer.mode=separate_async (the default where one machine's CPU holds the whole run:
see DppoConfig.use_ray). The workers generate while the trainer trains, as on Ray, with the same tickets,
staleness rules, score-ahead and restarts; what is not here is Ray's start-up (its services and one more process
per role, each importing torch and transformers: about 8-10 s before the first step on a 2-core machine).

- Workers (dppo.workers.rollout.process): the first incarnations are forked from this process before the actor's
  rank is built, while it runs no other thread that could hold a lock and has no CUDA context, so they start with
  torch, transformers and dppo imported; a worker that replaces a dead one, and the workers of a resumed run, are
  spawned (a fresh interpreter: forking a process whose other threads may hold locks is not safe). Each worker
  calls the buffer (BufferServer, in this process) through its own pipe, answered here by one thread per worker
  (dppo.workers.rollout.process.answer_calls).
- Weights: publish() copies the rank's state dict into one anonymous shared-memory file (a tied weight once); a
  worker's ticket carries where each tensor lies in it and the file's descriptor follows on the worker's pipe; the
  worker maps it and copies the weights into its model. The kernel frees a version once the trainer has replaced
  it and every worker has unmapped it.
- Faults (dppo.trainer.rollout.supervised): a worker whose process dies is restarted up to rollout.max_restarts
  times, its outstanding tickets granted again (rollout/worker_restarts); a worker that raises ends the run with
  RolloutFailedError naming the error, and so does a failure of the thread here that answers a worker's pipe (the
  worker, which would wait for its answer for ever, is stopped). The workers die with this process
  (PR_SET_PDEATHSIG), however it ends.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import torch

from dppo._text import one_line
from dppo.lora import LoraPublish
from dppo.trainer.state import RolloutStart
from dppo.data.source import PromptSource
from dppo.trainer.rollout.common import RolloutSettings, buffer_core
from dppo.trainer.rollout.settings import worker_settings
from dppo.trainer.rollout.supervised import SupervisedRollout, WorkerEnd, WorkerRecord
from dppo.workers.rollout.buffer_server import BufferServer, Taken
from dppo.workers.rollout.process import SharedLora, SharedState, answer_calls, main
from dppo.workers.sync_check import WeightSyncMismatchError
from dppo.workers.weight_fingerprint import fingerprint_for, print_dtype

POLL_S = 0.5  # how often a waiting fetch looks at the workers' processes
# Threads a fork may leave behind: they hold no lock while they block (dppo.stopping's watcher reads a pipe).
FORK_SAFE_THREADS = frozenset({"dppo-stop-watcher"})


@dataclass
class LocalWorker(WorkerRecord):
    """One incarnation of a rollout worker as a local process, and the thread here that serves its pipe."""

    process: Any = None
    conn: Any = None
    error: tuple[str, str] | None = None  # what it reported before exiting with an error: (type name, message)
    served_error: str | None = None  # what failed in the thread here that answers it ("TypeName: message")
    server: threading.Thread | None = field(default=None, repr=False)


class LocalRollout(SupervisedRollout[LocalWorker]):
    """Rollout workers as local processes (see the module docstring)."""

    def __init__(self, cfg, source: PromptSource, model_config, start: RolloutStart, fork: bool = False) -> None:
        """cfg: the root config, read here: the workers get their RolloutWorkerSettings (worker_settings), the rest
        reads RolloutSettings.of(cfg). fork: the first workers may be forked (made before the actor's rank, whose
        threads a fork would copy half of); they still are not where this process runs other Python threads or
        holds a CUDA context."""
        super().__init__(RolloutSettings.of(cfg), start)
        self.buffer = BufferServer(buffer_core(self.settings, start))
        self._payload = cloudpickle.dumps((worker_settings(cfg, source, model_config), source, model_config))
        self._print_dtype = print_dtype(cfg.rollout, cfg.model.dtype)  # None: rollout.verify_sync=false
        # rollout.partial_rollout: the newest published version, which the workers read once per decode chunk
        self._published_version = multiprocessing.RawValue("q", -1) if cfg.rollout.partial_rollout else None
        self._lora_base: tuple[str, SharedState] | None = None  # (base id, its shared memory): a LoRA run's, once
        ctx = self._context(fork)
        self.workers = [
            self._start(i, self.new_holder(), 0, ctx)  # all forked before any thread
            for i in range(self.settings.rollout.num_workers)
        ]
        for worker in self.workers:
            self._listen(worker)

    @staticmethod
    def _context(fork: bool):
        """fork where it is safe (no other Python thread, no CUDA context: the worker starts with everything
        imported), else spawn."""
        others = [
            t for t in threading.enumerate() if t is not threading.main_thread() and t.name not in FORK_SAFE_THREADS
        ]
        if fork and not others and not torch.cuda.is_initialized():
            return multiprocessing.get_context("fork")
        return multiprocessing.get_context("spawn")

    def _start(self, index: int, holder: int, restarts: int, ctx) -> LocalWorker:
        ours, theirs = ctx.Pipe(duplex=True)
        process = ctx.Process(
            target=main,
            args=(theirs, self._payload, index, os.getpid(), self._published_version),
            name=f"dppo-rollout-{index}",
            daemon=True,
        )
        process.start()
        theirs.close()  # the worker's end lives in the worker now: EOF here once it exits
        return LocalWorker(index, holder, restarts, process, ours)

    def _spawn(self, index: int, holder: int, restarts: int) -> LocalWorker:
        """A fresh interpreter (a fork now would copy this process's threads), served at once."""
        worker = self._start(index, holder, restarts, self._context(fork=False))
        self._listen(worker)
        return worker

    def _listen(self, worker: LocalWorker) -> None:
        worker.server = threading.Thread(
            target=self._serve, args=(worker,), name=f"dppo-rollout-pipe-{worker.index}", daemon=True
        )
        worker.server.start()

    def _serve(self, worker: LocalWorker) -> None:
        """Answer worker's calls until its pipe closes (it exited, or close() closed it). Where answering fails here
        (the buffer raised, an answer could not be sent), the worker would wait for its answer for ever: it is
        stopped, and the trainer's next look at it ends the run naming what failed."""
        try:
            worker.error = answer_calls(worker.conn, self.buffer, worker.holder, worker.process.pid)
        except Exception as err:  # noqa: BLE001  raised in the trainer by _ended, not lost with this thread
            worker.served_error = f"{type(err).__name__}: {one_line(err)}"
            worker.process.kill()
        finally:
            self.buffer.wake()  # a fetch waiting on this worker looks at it now

    def start(self) -> None:
        pass  # the workers ask for tickets as soon as they are up; the first one waits for the first publish

    def publish(self, state_dict, version: int) -> None:
        """The rank's state dict (CPU tensors, possibly the live ones): copied into shared memory for the workers;
        what published_weights() gives back once the buffer has it (a publish that failed leaves the last one's)."""
        if isinstance(state_dict, LoraPublish):  # the base into shared memory once per run, the adapter each time
            if self._lora_base is None or self._lora_base[0] != state_dict.base_id:
                self._lora_base = (state_dict.base_id, SharedState(state_dict.base_state()))
            shared = SharedLora(state_dict, self._lora_base[1])
        else:
            shared = SharedState(state_dict)
        self.buffer.publish(shared, version, fingerprint_for(state_dict, self._print_dtype))
        self._published = shared
        if self._published_version is not None:
            self._published_version.value = version

    def published_weights(self) -> dict[str, torch.Tensor]:
        """The weights of the last publish, exactly as published: views of the shared-memory copy the workers load."""
        return self._published.state_dict()

    def _taking(self, num_groups: int, trainer_version: int) -> Callable[[], Taken | None]:
        """A wait until the groups are there, a worker's pipe closed, or POLL_S passed (a worker's process may be gone
        with its pipe still open: the check after it looks at the processes)."""
        return lambda: self.buffer.take(num_groups, trainer_version, wait_s=POLL_S)

    def _buffer_call(self, name: str, *args) -> Any:
        return getattr(self.buffer, name)(*args)

    def _check_buffer(self) -> None:
        pass  # the buffer lives in this process: it cannot die apart from it

    def _ended(self, worker: LocalWorker) -> WorkerEnd | None:
        """A worker's process ends only by failing: it raised (and said what over its pipe), or it died."""
        if worker.process.is_alive():
            return None
        worker.process.join()
        # its pipe is closed: the thread reads what the worker sent last, unless it waits for a ticket for the
        # dead worker (it then sends the stop ticket that _restart's release makes, into a closed pipe)
        worker.server.join(timeout=1.0)
        if worker.served_error is not None:
            return WorkerEnd("unserved", worker.served_error)
        if worker.error is not None:
            type_name, message = worker.error
            if type_name == WeightSyncMismatchError.__name__:
                return WorkerEnd("mismatch", message)
            return WorkerEnd("raised", f"{type_name}: {message}")
        return WorkerEnd("died", _exit_in_words(worker.process.exitcode))

    def _retire(self, worker: LocalWorker) -> None:
        worker.conn.close()

    def describe(self) -> str:
        pids = ", ".join(str(w.process.pid) for w in self.workers)
        return f"rollout: {len(self.workers)} worker process(es) on this machine, no Ray (pid {pids})"

    def close(self) -> None:
        """Kill the workers (the run is over, or failed: nothing they would still generate is wanted) and free the
        shared weights; never raises."""
        self.buffer.close()  # a worker waiting for a ticket gets a stop ticket
        for worker in self.workers:
            try:
                worker.process.kill()
                worker.process.join()
                worker.conn.close()
            except (OSError, ValueError):  # a process already reaped, a pipe already closed
                pass
        self.buffer.core.weights = None


def _exit_in_words(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"
