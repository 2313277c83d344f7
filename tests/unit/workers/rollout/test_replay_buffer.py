"""Replay buffer: staleness accounting, the drop and wait strategies, weight hand-off, stop tickets."""

import random

import pytest
import torch

from dppo.batch import Group
from dppo.workers.rollout.replay_buffer import Finished, ReplayBufferCore


def group(version: int) -> Group:
    return Group(
        torch.zeros(3, dtype=torch.long),
        torch.zeros(2, 4, dtype=torch.long),
        torch.ones(2, 4, dtype=torch.bool),
        torch.zeros(2, 4),
        torch.zeros(2),
        version,
    )


def test_no_ticket_before_weights_and_tickets_carry_newer_weights_only():
    buf = ReplayBufferCore(1, "wait", groups_per_version=4)
    assert buf.acquire(-1, 2) is None
    buf.publish("w0", 0)
    ticket = buf.acquire(-1, 2)
    assert (ticket.num_groups, ticket.version, ticket.publish.weights, ticket.stop) == (2, 0, "w0", False)
    assert buf.acquire(0, 2).publish is None  # the worker already has version 0
    with pytest.raises(ValueError, match="not newer"):
        buf.publish("again", 0)


def test_wait_strategy_budget_is_eta_plus_one_versions_ahead():
    eta, per_version = 1, 4
    buf = ReplayBufferCore(eta, "wait", groups_per_version=per_version)
    buf.publish("w0", 0)
    got = 0
    while (ticket := buf.acquire(0, 3)) is not None:
        got += ticket.num_groups
        buf.put(Finished([group(0) for _ in range(ticket.num_groups)], ticket.first))
    assert got == (eta + 1) * per_version  # generation with version 0 may run one version ahead, no more
    assert buf.take(4, trainer_version=0)[0][0].version == 0
    assert buf.acquire(0, 1) is None  # taking does not free budget; a new version does
    buf.publish("w1", 1)
    ticket = buf.acquire(0, 10)
    assert (ticket.num_groups, ticket.version, ticket.publish.weights) == (per_version, 1, "w1")


def test_drop_strategy_drops_and_counts_stale_groups():
    buf = ReplayBufferCore(1, "drop", groups_per_version=2)
    buf.publish("w0", 0)
    buf.put(Finished([group(0), group(0), group(0), group(0)], buf.acquire(-1, 4).first))
    buf.publish("w1", 1)
    buf.publish("w2", 2)
    assert buf.take(1, trainer_version=2) is None  # all four are 2 versions old: dropped, nothing to take
    assert buf.stats()["replay/dropped_total"] == 4
    buf.put(Finished([group(2), group(1)], buf.acquire(0, 2).first))
    taken, dropped = buf.take(2, trainer_version=2)
    assert [g.version for g in taken] == [2, 1] and dropped == 4
    assert buf.take(0, trainer_version=2) == ([], 0)  # the drop count was reported once


def test_drop_strategy_caps_buffered_plus_in_flight():
    buf = ReplayBufferCore(0, "drop", groups_per_version=3)
    buf.publish("w", 0)
    ticket = buf.acquire(-1, 10)
    assert ticket.num_groups == 3
    assert buf.acquire(0, 1) is None
    buf.put(Finished([group(0)] * 3, ticket.first))
    buf.take(2, 0)
    assert buf.acquire(0, 10).num_groups == 2


def test_close_gives_stop_tickets():
    buf = ReplayBufferCore(1, "wait", groups_per_version=2)
    buf.publish("w", 0)
    buf.close()
    assert buf.acquire(0, 1).stop


def test_wait_strategy_takes_in_grant_order_so_a_slow_workers_groups_never_go_stale():
    """Worker A is granted groups first, then the fast worker B; B's arrive first. The trainer waits for A's
    instead of taking B's ahead of them (with eta=0, A's would be stale once B's had filled version 0)."""
    buf = ReplayBufferCore(0, "wait", groups_per_version=2)
    buf.publish("w0", 0)
    slow, fast = buf.acquire(-1, 1), buf.acquire(-1, 1)
    assert (slow.first, fast.first) == (0, 1)
    buf.put(Finished([group(0)], fast.first))
    assert buf.take(1, trainer_version=0) is None  # grant 0 is still in flight: nothing is popped
    assert buf.stats() == {
        "replay/size": 1.0,
        "replay/in_flight": 1.0,
        "replay/dropped_total": 0.0,
        "replay/regranted_total": 0.0,
    }
    buf.put(Finished([group(0)], slow.first))
    taken, dropped = buf.take(2, trainer_version=0)
    assert [g.version for g in taken] == [0, 0] and dropped == 0
    assert buf.stats() == {
        "replay/size": 0.0,
        "replay/in_flight": 0.0,
        "replay/dropped_total": 0.0,
        "replay/regranted_total": 0.0,
    }
    with pytest.raises(ValueError, match="put of 1 groups at grant index 0 by holder None: no outstanding ticket"):
        buf.put(Finished([group(0)], slow.first))  # the same ticket twice


def test_a_dead_workers_tickets_are_granted_again_and_every_group_is_taken_once():
    buf = ReplayBufferCore(1, "wait", groups_per_version=4)
    buf.publish("w0", 0)
    a, b = buf.acquire(-1, 3, holder="a"), buf.acquire(-1, 2, holder="b")
    assert (a.first, a.num_groups, b.first, b.num_groups) == (0, 3, 3, 2)
    assert buf.release("a") == 3  # worker a died holding grants 0, 1, 2
    assert buf.stats()["replay/in_flight"] == 5.0 and buf.stats()["replay/regranted_total"] == 3.0
    with pytest.raises(ValueError, match="by holder 'a'"):
        buf.put(Finished([group(0)] * 3, a.first), "a")  # a put that was still on its way from the dead worker
    assert buf.acquire(-1, 3, holder="a").stop  # and a request it had sent before it died
    first, rest = buf.acquire(-1, 2, holder="c"), buf.acquire(0, 5, holder="c")  # c restarts a: a's grants first
    assert (first.first, first.num_groups, first.publish.weights, rest.first, rest.num_groups) == (0, 2, "w0", 2, 1)
    assert buf.acquire(0, 1, holder="c").first == 5  # then new ones
    for ticket, holder in ((b, "b"), (rest, "c"), (first, "c")):
        buf.put(Finished([group(0) for _ in range(ticket.num_groups)], ticket.first), holder)
    taken, dropped = buf.take(5, trainer_version=0)
    assert [g.index for g in taken] == [0, 1, 2, 3, 4] and dropped == 0


def test_a_resumed_buffer_continues_the_grant_indices_and_the_wait_budget():
    """After 2 versions of 4 groups and one trigger of 2 more, a new buffer grants from index 10 on, and allows
    exactly what the old one would still have allowed."""
    fresh = ReplayBufferCore(1, "wait", groups_per_version=4)
    fresh.publish("w", 0)
    while (ticket := fresh.acquire(0, 1)) is not None:
        fresh.put(Finished([group(0)], ticket.first))
    fresh.publish("w", 1), fresh.publish("w", 2)
    fresh.take(4, 1), fresh.take(4, 2), fresh.take(2, 2)
    resumed = ReplayBufferCore(1, "wait", groups_per_version=4, start_version=2, start_consumed=10, start_grant=10)
    resumed.publish("w", 2)
    assert resumed.acquire(-1, 100).first == 10
    assert resumed.grantable() == 0 and resumed.granted - 10 == (2 + 1 + 1) * 4 - 10


@pytest.mark.parametrize("strategy", ["wait", "drop"])
@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("eta", [0, 1, 2])
@pytest.mark.parametrize("deaths", [False, True])
def test_random_schedules_never_hand_out_a_group_staler_than_eta(strategy, workers, eta, deaths):
    """Workers of random speeds and the trainer interleave at random; every consumed group has staleness <= eta,
    the trainer never starves forever, and with the wait strategy nothing is ever dropped, for any number of
    workers (the trainer takes in grant order, so a slow worker's older groups are not passed by). With deaths,
    workers die at random holding their tickets and are replaced: every group is still taken once or dropped,
    none lost, none twice."""
    rng = random.Random(eta * 10 + workers + 100 * deaths)
    per_version, per_take = 8, 2
    buf = ReplayBufferCore(eta, strategy, groups_per_version=per_version)
    trainer_version, taken_in_version = 0, 0
    buf.publish("w0", 0)
    worker_versions = [-1] * workers
    holders = list(range(workers))  # the current incarnation of each worker
    finish_prob = [rng.uniform(0.05, 1.0) for _ in range(workers)]  # per step: slow and fast workers
    pending = [None] * workers  # (version, count, first grant index) being generated
    staleness, taken_indices = [], []
    for _ in range(4000):
        i = rng.randrange(workers + 1)
        if i < workers and deaths and rng.random() < 0.02:  # worker i dies, whatever it holds; a new one starts
            buf.release(holders[i])
            holders[i], worker_versions[i], pending[i] = holders[i] + workers, -1, None
        elif i < workers:  # a worker finishes its batch or starts a new one
            if pending[i] is not None:
                if rng.random() < finish_prob[i]:
                    version, count, first = pending[i]
                    buf.put(Finished([group(version) for _ in range(count)], first), holders[i])
                    pending[i] = None
            elif (ticket := buf.acquire(worker_versions[i], rng.randint(1, 5), holders[i])) is not None:
                if ticket.publish is not None:
                    worker_versions[i] = ticket.version
                pending[i] = (worker_versions[i], ticket.num_groups, ticket.first)
        else:  # the trainer tries to take one trigger's groups
            result = buf.take(per_take, trainer_version)
            if result is not None:
                staleness += [trainer_version - g.version for g in result[0]]
                taken_indices += [g.index for g in result[0]]
                taken_in_version += per_take
                if taken_in_version == per_version:
                    trainer_version, taken_in_version = trainer_version + 1, 0
                    buf.publish(f"w{trainer_version}", trainer_version)
    assert trainer_version > 20, "the schedule must make progress"
    assert max(staleness) <= eta
    assert len(set(taken_indices)) == len(taken_indices)  # no group taken twice
    if deaths:
        assert buf.regranted_total > 0
    if strategy == "wait":
        assert buf.dropped_total == 0
        assert taken_indices == list(range(len(taken_indices)))  # in grant order, none lost
    else:  # every grant index up to the last one taken was taken, dropped, or is still to come
        accounted = len(taken_indices) + buf.dropped_total + len(buf.groups) + buf.in_flight
        assert accounted == buf.granted
