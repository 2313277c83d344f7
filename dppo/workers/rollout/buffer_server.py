"""The replay buffer's server side: ReplayBufferCore behind one lock, waiting where the core says "not yet".

One class, BufferServer, serves the buffer everywhere a worker runs in a process of its own:

- Ray (ReplayBufferActor, a threaded actor: each call in a thread of its own): the workers call its methods through
  their actor handle (dppo.workers.rollout.ray_worker), the trainer through its own (dppo.trainer.rollout.ray_source);
- local worker processes: the trainer's process holds it; one thread per worker answers that worker's pipe by
  calling the method its message names (dppo.workers.rollout.process.answer_calls), and the trainer calls it directly
  (dppo.trainer.rollout.local_source).

The worker side is the buffer-client protocol (dppo.workers.rollout.buffer_client: acquire, newer, put), each method
taking the calling worker's holder id last; the trainer side is the rest (publish, take, take_ready, discard,
release, close, stats). A worker in the trainer's own process (trainer.mode=sync without Ray) needs no server: it
generates between the trainer's steps, and calls ReplayBufferCore directly (buffer_client.InProcessClient).

The module imports neither torch nor the worker's model code: it is all the buffer's Ray process imports.
"""

from __future__ import annotations

import threading
from typing import Any

from dppo.workers.rollout.replay_buffer import Finished, Published, ReplayBufferCore, Ticket

Taken = tuple[list, int]  # what a take returns: (the groups, the number dropped since the last take)

# The buffer-client protocol's calls, the ones a worker may make (a local worker's pipe answers these names only).
WORKER_CALLS = frozenset({"acquire", "newer", "put"})


class BufferServer:
    """A ReplayBufferCore that several threads call (workers and the trainer): every call holds one lock; acquire waits
    until the core grants, take until the groups are there, and each call that changes the buffer wakes the waiters."""

    def __init__(self, core: ReplayBufferCore) -> None:
        self.core = core
        self._changed = threading.Condition()

    def _changing(self, name: str, *args) -> Any:
        """The core's method `name` called with args; then every waiter looks again (groups put or taken, weights
        published, a holder released, budget freed)."""
        with self._changed:
            result = getattr(self.core, name)(*args)
            self._changed.notify_all()
            return result

    # ---- the worker side: the buffer-client protocol ---------------------------------------------------------------

    def acquire(self, worker_version: int, num_groups: int, holder: Any = None) -> Ticket:
        """ReplayBufferCore.acquire, waiting until it grants (a stop ticket once closed or holder was released)."""
        with self._changed:
            while (ticket := self.core.acquire(worker_version, num_groups, holder)) is None:
                self._changed.wait()
            return ticket

    def newer(self, worker_version: int, holder: Any = None) -> Published | None:
        """ReplayBufferCore.newer; never waits. holder: unused (a look grants nothing), taken as every worker call's."""
        with self._changed:
            return self.core.newer(worker_version)

    def put(self, finished: Finished, holder: Any = None) -> None:
        self._changing("put", finished, holder)

    # ---- the trainer side ------------------------------------------------------------------------------------------

    def publish(self, weights: Any, version: int, fingerprint: Any = None) -> None:
        """On Ray, weights is [ObjectRef] (a list, so Ray passes the reference, not the tensors)."""
        self._changing("publish", weights, version, fingerprint)

    def take(self, num_groups: int, trainer_version: int, wait_s: float | None = None) -> Taken | None:
        """ReplayBufferCore.take, waiting for the groups: with wait_s None as long as it takes; else at most one wait,
        until the buffer next changes or wait_s passed, and one more look (None: not there yet; a caller that watches
        its workers looks at them in between: wake() ends the wait); wait_s=0: none (take_ready)."""
        with self._changed:
            while (taken := self._changing("take", num_groups, trainer_version)) is None and wait_s != 0:
                self._changed.wait(wait_s)
                if wait_s is not None:
                    return self._changing("take", num_groups, trainer_version)
            return taken

    def take_ready(self, num_groups: int, trainer_version: int) -> Taken | None:
        """take without waiting: the groups take would return if they are all there now, else None (nothing popped;
        under drop, stale groups are dropped all the same, as take's first look would)."""
        return self.take(num_groups, trainer_version, wait_s=0)

    def discard(self, count: int) -> None:
        self._changing("discard", count)  # freed budget: a waiting worker may go on

    def release(self, holder: Any) -> int:
        return self._changing("release", holder)

    def close(self) -> None:
        self._changing("close")  # every waiting acquire gets its stop ticket

    def stats(self) -> dict[str, float]:
        with self._changed:
            return self.core.stats()

    def wake(self) -> None:
        """End the waits in progress without a change (a worker's pipe closed: the trainer's take looks at it now)."""
        with self._changed:
            self._changed.notify_all()


class ReplayBufferActor(BufferServer):
    """BufferServer as a Ray actor: the core made in the actor's process from ReplayBufferCore's arguments. Its calls
    wait in threads of their own (ray.remote(max_concurrency=threads(...)))."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(ReplayBufferCore(*args, **kwargs))

    @staticmethod
    def threads(num_workers: int) -> int:
        """Threads enough that a call never waits for one: each worker waits in at most one acquire (a dead one's
        until its release), the trainer in one take, and every other call returns at once (a newer per worker in
        flight, a put, the trainer's publish, stats, ...)."""
        return 2 * num_workers + 8
