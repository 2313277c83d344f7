"""Rollout workers that the trainer's process supervises: what RayRollout and LocalRollout share.

Each worker runs the same loop (dppo.workers.rollout.buffer_client.run_ticket: ticket from the replay buffer -> load
newer weights -> generate -> put) against the same server (dppo.workers.rollout.buffer_server.BufferServer). The
trainer keeps one record per worker (its index, its holder id at the buffer, its restarts so far, its handle) and looks
at the workers whenever it would wait for groups, and before it takes the groups that have already arrived:

- a worker whose process died is restarted, up to rollout.max_restarts times per worker: its dead incarnation is
  retired, the buffer grants its outstanding tickets again (release), and a new incarnation with a new holder id
  takes its place, so the groups it was generating are generated anew (rollout/worker_restarts counts it);
- a worker whose engine failed its weight sync check (rollout.verify_sync: it does not hold the weights it loaded)
  is restarted the same way: the new incarnation loads the full weights afresh;
- a worker that raised, or whose loop stopped on its own, ends the rollout, and so does a death or a failed check
  once its restarts are used up: one RolloutFailedError line naming the worker and what happened.

A subclass supplies only what differs: how a worker is spawned and retired, how its end is observed, how the buffer
is reached, and the take that waits (while it watches the workers).
"""

from __future__ import annotations

import abc
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from dppo.batch import Group
from dppo.trainer.state import RolloutStart
from dppo.trainer.rollout.common import RolloutFailedError, RolloutSettings, groups_of
from dppo.trainer.rollout.source import RolloutSource
from dppo.workers.rollout.buffer_server import Taken

log = logging.getLogger("dppo.rollout")


@dataclass
class WorkerRecord:
    """One incarnation of rollout worker `index` (a subclass adds its handle: a Ray actor, a local process)."""

    index: int
    holder: int  # its id at the replay buffer (a restarted worker gets a new one)
    restarts: int  # how often worker `index` was restarted before this incarnation


@dataclass(frozen=True)
class WorkerEnd:
    """How a worker's incarnation ended: it died (its process is gone) or its engine failed its weight sync check
    (mismatch: WeightSyncMismatchError), both restarted while restarts are left; raised, stopped on its own, or
    unserved: the trainer's side of its channel failed to answer it (the worker was stopped; all three end the
    rollout). detail: how it died in words ("was killed by SIGKILL", "died"), or what was raised ("RuntimeError: ...",
    for mismatch the error's message)."""

    kind: Literal["died", "mismatch", "raised", "stopped", "unserved"]
    detail: str = ""


W = TypeVar("W", bound=WorkerRecord)


class SupervisedRollout(RolloutSource, Generic[W]):
    """A rollout source whose workers this process starts, watches and restarts (see the module docstring)."""

    def __init__(self, settings: RolloutSettings, start: RolloutStart) -> None:
        self.settings = settings
        self._worker_restarts = start.worker_restarts
        self._holders = itertools.count()
        self.workers: list[W] = []  # the current incarnation of each worker, by index

    @property
    def worker_restarts(self) -> int:
        return self._worker_restarts

    def new_holder(self) -> int:
        """A holder id at the buffer that no incarnation had before."""
        return next(self._holders)

    # ---- what a subclass supplies ---------------------------------------------------------------------------

    @abc.abstractmethod
    def _spawn(self, index: int, holder: int, restarts: int) -> W:
        """A new incarnation of worker index, replacing a dead one, started and generating as the mode says."""

    @abc.abstractmethod
    def _retire(self, worker: W) -> None:
        """Let go of a dead incarnation (what it still holds: an actor handle, a pipe)."""

    @abc.abstractmethod
    def _ended(self, worker: W) -> WorkerEnd | None:
        """How worker's incarnation ended, or None while it runs; without waiting."""

    @abc.abstractmethod
    def _check_buffer(self) -> None:
        """RolloutFailedError if the replay buffer is gone (a worker's failure may be the buffer's)."""

    @abc.abstractmethod
    def _buffer_call(self, name: str, *args) -> Any:
        """The replay buffer's (BufferServer's) method `name` called with args: its result."""

    @abc.abstractmethod
    def _taking(self, num_groups: int, trainer_version: int) -> Callable[[], Taken | None]:
        """A take of num_groups groups at trainer_version, begun: a function that waits for it a while (until the
        groups are there, or something happened to a worker) and returns what was taken, or None for not yet."""

    # ---- the shared logic ------------------------------------------------------------------------------------

    def fetch(self, num_groups: int, trainer_version: int) -> tuple[list[Group], int]:
        wait = self._taking(num_groups, trainer_version)
        while (taken := wait()) is None:
            self._check_workers()  # a worker that died meanwhile is restarted, or what ended one is raised
        return groups_of(taken)

    def fetch_ready(self, num_groups: int, trainer_version: int) -> tuple[list[Group], int] | None:
        self._check_workers()  # fetch notices a dead worker while it waits; this takes without waiting
        return groups_of(self._buffer_call("take_ready", num_groups, trainer_version))

    def discard(self, count: int) -> None:
        self._buffer_call("discard", count)

    def stats(self) -> dict[str, float]:
        return {**self._buffer_call("stats"), "rollout/worker_restarts": float(self._worker_restarts)}

    def _check_workers(self) -> None:
        """Restart each worker whose process has died, or raise what ended one; without waiting."""
        for worker in list(self.workers):
            end = self._ended(worker)
            if end is not None:
                self._settle(worker, end)

    def _settle(self, worker: W, end: WorkerEnd) -> None:
        """Restart worker if it died; RolloutFailedError naming it if it raised or stopped on its own (or the
        buffer's own failure, where the buffer is gone)."""
        if end.kind == "died":
            self._restart(worker, end.detail)
            return
        if end.kind == "mismatch":
            self._restart(worker, f"failed its weight sync check ({end.detail})")
            return
        self._check_buffer()
        if end.kind == "raised":
            raise RolloutFailedError(f"rollout worker {worker.index} raised {end.detail}")
        if end.kind == "unserved":
            raise RolloutFailedError(
                f"the trainer failed to answer rollout worker {worker.index} ({end.detail}); the worker was stopped"
            )
        raise RolloutFailedError(f"rollout worker {worker.index} stopped before the trainer finished")

    def _restart(self, worker: W, how: str) -> None:
        """worker's process died (how: in words): a new incarnation takes its place and its outstanding tickets are
        granted again; RolloutFailedError once its restarts are used up."""
        self._check_buffer()
        limit = self.settings.rollout.max_restarts
        if worker.restarts >= limit:
            raise RolloutFailedError(
                f"rollout worker {worker.index} {how} and its restarts are used up "
                f"({worker.restarts} of rollout.max_restarts={limit})"
            )
        self._retire(worker)
        regranted = self._buffer_call("release", worker.holder)
        self.workers[worker.index] = self._spawn(worker.index, self.new_holder(), worker.restarts + 1)
        self._worker_restarts += 1
        log.warning(
            f"rollout worker {worker.index} {how}; restarted it ({worker.restarts + 1} of "
            f"rollout.max_restarts={limit}); its {regranted} outstanding groups are generated anew"
        )
