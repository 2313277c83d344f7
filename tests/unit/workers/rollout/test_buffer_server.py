"""BufferServer: the replay buffer served to threads (the Ray actor's, a local rollout's pipe threads and its trainer):
a waiting acquire goes on when a publish, a discard or a close lets it, a waiting take when the groups arrive or
wake() is called; take_ready never waits. Each waiter is seen waiting before the call that must free it."""

from __future__ import annotations

import threading
import time

import torch

from dppo.batch import Group
from dppo.workers.rollout.buffer_server import BufferServer
from dppo.workers.rollout.replay_buffer import Finished, ReplayBufferCore


def _group() -> Group:
    return Group(
        torch.zeros(3, dtype=torch.long),
        torch.zeros(2, 4, dtype=torch.long),
        torch.ones(2, 4, dtype=torch.bool),
        torch.zeros(2, 4),
        torch.zeros(2),
        0,
    )


class Call(threading.Thread):
    """fn() in a thread of its own; result once it returned."""

    def __init__(self, fn) -> None:
        super().__init__(daemon=True)
        self.fn, self.result, self.returned = fn, None, False

    def run(self) -> None:
        self.result, self.returned = self.fn(), True


def _waiting(server: BufferServer, count: int) -> None:
    """Until count threads wait on the server's condition (an event, not a delay: the call under test comes after)."""
    deadline = time.monotonic() + 30
    while len(server._changed._waiters) < count:  # noqa: SLF001  CPython's Condition keeps its waiters there
        assert time.monotonic() < deadline, "the call never started waiting"
        time.sleep(0.001)


def _returned(call: Call):
    call.join(timeout=30)
    assert call.returned, "the call is still waiting"
    return call.result


def test_a_waiting_acquire_is_granted_by_the_first_publish_and_another_stopped_by_close():
    server = BufferServer(ReplayBufferCore(0, "wait", 2))  # a version's budget: 2 groups
    first = Call(lambda: server.acquire(-1, 2, "a"))
    first.start()
    _waiting(server, 1)  # no weights yet: nothing to generate with
    server.publish("w0", 0)
    ticket = _returned(first)
    assert (ticket.first, ticket.num_groups, ticket.publish.weights) == (0, 2, "w0")
    second = Call(lambda: server.acquire(0, 2, "b"))  # the budget is spent
    second.start()
    _waiting(server, 1)
    server.close()
    assert _returned(second).stop


def test_a_discard_frees_budget_for_a_waiting_acquire():
    server = BufferServer(ReplayBufferCore(0, "wait", 2))
    server.publish("w0", 0)
    ticket = server.acquire(-1, 2, "a")
    server.put(Finished([_group(), _group()], ticket.first), "a")
    assert len(server.take_ready(2, 0)[0]) == 2
    waiting = Call(lambda: server.acquire(0, 2, "a"))  # the version's budget is spent
    waiting.start()
    _waiting(server, 1)
    server.discard(2)  # the trainer trains on none of them (algorithm.filter_groups)
    assert _returned(waiting).first == 2


def test_a_take_waits_for_the_groups_and_a_bounded_take_also_for_a_wake():
    server = BufferServer(ReplayBufferCore(1, "wait", 2))
    server.publish("w0", 0)
    ticket = server.acquire(-1, 2, "a")
    assert server.take_ready(2, 0) is None  # never waits
    take = Call(lambda: server.take(2, 0))
    take.start()
    _waiting(server, 1)
    server.put(Finished([_group(), _group()], ticket.first), "a")
    taken, dropped = _returned(take)
    assert [g.index for g in taken] == [0, 1] and dropped == 0
    bounded = Call(lambda: server.take(2, 0, wait_s=600.0))  # a local rollout's: POLL_S, then it looks at its workers
    bounded.start()
    _waiting(server, 1)
    server.wake()  # a worker's pipe closed
    assert _returned(bounded) is None
