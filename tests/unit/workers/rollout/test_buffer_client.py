"""The worker loop (buffer_client.run_ticket) over a scripted client and a recording generator: the order of its calls,
what put reports, a stop; the in-process client over a real ReplayBufferCore; the pipe's two ends (PipeClient and
answer_calls) over a real pipe in this process: weights through shared memory, a look that reads the counter only."""

from __future__ import annotations

import multiprocessing
import os
import threading
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from dppo.batch import Group
from dppo.workers.rollout.buffer_client import BufferClient, InProcessClient, run_ticket, run_tickets
from dppo.workers.rollout.buffer_server import BufferServer
from dppo.workers.rollout.process import PipeClient, SharedState, answer_calls
from dppo.workers.rollout.replay_buffer import Finished, Published, ReplayBufferCore, StoredGroup, Ticket
from dppo.workers.rollout.worker import StateDictWeights


def group(version: int) -> Group:
    return Group(
        torch.zeros(3, dtype=torch.long),
        torch.zeros(2, 4, dtype=torch.long),
        torch.ones(2, 4, dtype=torch.bool),
        torch.zeros(2, 4),
        torch.zeros(2),
        version,
    )


class ScriptedClient(BufferClient):
    """Hands out `tickets` in turn (then stop tickets) and `looks` in turn (then None); records every call."""

    def __init__(self, tickets: list[Ticket], looks: list[Published | None] = (), looks_mid_ticket: bool = True):
        self.tickets, self.looks, self.looks_mid_ticket = list(tickets), list(looks), looks_mid_ticket
        self.calls: list[tuple] = []

    def acquire(self, version: int, num_groups: int) -> Ticket:
        self.calls.append(("acquire", version, num_groups))
        return self.tickets.pop(0) if self.tickets else Ticket(0, version, stop=True)

    def newer(self, version: int) -> Published | None:
        self.calls.append(("newer", version))
        return self.looks.pop(0) if self.looks else None

    def put(self, finished: Finished) -> None:
        self.calls.append(("put", finished))


class RecordingGenerator:
    """What the loop touches of a RolloutGenerator; generate() looks `looks` times (rollout.partial_rollout's refresh)
    and loads what a look finds, as an engine does."""

    def __init__(self, looks: int = 0) -> None:
        self.version, self.looks, self.calls = -1, looks, []

    def load(self, published: Published) -> str:
        self.calls.append(("load", published.version, published.weights, published.fingerprint))
        self.version = published.version
        return f"sync of version {published.version}"

    def seed_ticket(self, first: int) -> None:
        self.calls.append(("seed", first))

    def generate(self, num_groups: int, refresh=None) -> list:
        self.calls.append(("generate", num_groups, refresh is not None))
        for _ in range(self.looks if refresh is not None else 0):
            load = refresh()
            if load is not None:
                self.calls.append(("loaded mid-ticket", load()))
        return [group(self.version) for _ in range(num_groups)]


V1 = Published(1, "weights of version 1", "fingerprint of version 1")
V2 = Published(2, "weights of version 2", "fingerprint of version 2")


def test_a_ticket_is_loaded_seeded_generated_and_put_back_with_its_latest_load():
    """acquire with the version held -> load the ticket's publish (with its fingerprint) -> seed from its grant index ->
    generate -> put; a look that finds a newer publish loads it mid-ticket, and put reports that load, not the
    first."""
    client = ScriptedClient([Ticket(2, 1, V1, first=6)], looks=[None, V2])
    generator = RecordingGenerator(looks=3)
    assert run_ticket(client, generator, 4) == 2
    assert generator.calls == [
        ("load", 1, "weights of version 1", "fingerprint of version 1"),
        ("seed", 6),
        ("generate", 2, True),
        ("load", 2, "weights of version 2", "fingerprint of version 2"),
        ("loaded mid-ticket", 2),
    ]
    *looks, (name, finished) = client.calls[1:]
    assert client.calls[0] == ("acquire", -1, 4)
    assert looks == [("newer", 1), ("newer", 1), ("newer", 2)]  # each look asks with the version held then
    assert name == "put" and (finished.first, finished.sync, len(finished.groups)) == (6, "sync of version 2", 2)


def test_a_ticket_without_weights_loads_nothing_and_puts_no_load():
    client = ScriptedClient([Ticket(1, 1, None, first=3)])
    generator = RecordingGenerator()
    generator.version = 1
    assert run_ticket(client, generator, 1) == 1
    assert generator.calls == [("seed", 3), ("generate", 1, True)]
    assert client.calls[-1][1].sync is None


def test_a_client_that_cannot_see_a_publish_mid_ticket_gives_the_engine_no_refresh():
    client = ScriptedClient([Ticket(1, 0, V1, first=0)], looks=[V2], looks_mid_ticket=False)
    generator = RecordingGenerator(looks=2)
    run_ticket(client, generator, 1)
    assert ("generate", 1, False) in generator.calls and ("newer", 1) not in client.calls


def test_a_stop_ticket_ends_the_loop_having_touched_nothing():
    client = ScriptedClient([Ticket(2, 1, V1, first=0), Ticket(2, 1, None, first=2)])
    generator = RecordingGenerator()
    run_tickets(client, generator, 2)
    assert [c[0] for c in client.calls] == ["acquire", "put", "acquire", "put", "acquire"]  # the third: stop
    assert [c for c in generator.calls if c[0] == "seed"] == [("seed", 0), ("seed", 2)]
    generator.calls.clear()
    assert run_ticket(client, generator, 2) == 0 and generator.calls == []


# ---- the in-process client over a real ReplayBufferCore ------------------------------------------------------------


def test_the_in_process_client_hands_out_the_trainers_state_dict_and_puts_groups_as_they_are():
    core = ReplayBufferCore(1, "wait", 4)
    client = InProcessClient(core)
    state = {"w": torch.ones(2)}
    core.publish(state, 0, "prints")
    ticket = client.acquire(-1, 2)
    assert isinstance(ticket.publish.weights, StateDictWeights) and ticket.publish.weights.state_dict is state
    assert (ticket.publish.version, ticket.publish.fingerprint, ticket.first) == (0, "prints", 0)
    assert client.acquire(0, 2).publish is None  # the worker holds version 0 already
    groups = [group(0), group(0)]
    client.put(Finished(groups, 0))
    taken, _ = core.take(2, 0)
    assert taken == groups  # the Groups themselves: nothing leaves this process
    core.publish(state, 1)
    assert client.newer(0) is None  # the trainer never publishes while its own process generates


def test_the_in_process_client_says_so_where_the_buffer_refuses():
    core = ReplayBufferCore(0, "wait", 1)
    core.publish({}, 0)
    InProcessClient(core).acquire(-1, 1)
    with pytest.raises(RuntimeError, match=r"replay buffer refused to grant groups in sync mode \(\{'replay/size'"):
        InProcessClient(core).acquire(0, 1)


# ---- the pipe's two ends, over a real pipe in this process -------------------------------------------------------


class CountingConn:
    """A connection that counts what it sends (the look must not use the pipe unless the counter is newer)."""

    def __init__(self, conn) -> None:
        self.conn, self.sent = conn, 0

    def send(self, message) -> None:
        self.sent += 1
        self.conn.send(message)

    def __getattr__(self, name):
        return getattr(self.conn, name)


@dataclass
class Pipe:
    """A PipeClient whose calls answer_calls answers in a thread, on a BufferServer, as holder 5 (what it returned:
    answered); the trainer's counter of its newest version."""

    client: PipeClient
    server: BufferServer
    published: Any
    thread: threading.Thread
    answered: list


@pytest.fixture
def pipe():
    ours, theirs = multiprocessing.Pipe(duplex=True)
    server, answered = BufferServer(ReplayBufferCore(1, "wait", 2)), []
    thread = threading.Thread(target=lambda: answered.append(answer_calls(ours, server, 5, os.getpid())), daemon=True)
    thread.start()
    published = multiprocessing.RawValue("q", -1)
    yield Pipe(PipeClient(CountingConn(theirs), published), server, published, thread, answered)
    theirs.close()
    thread.join(timeout=10)
    ours.close()


def _publish(server: BufferServer, published, state: dict, version: int) -> SharedState:
    shared = SharedState(state)
    server.publish(shared, version, f"prints of {version}")
    published.value = version
    return shared


def test_the_pipe_carries_the_weights_as_shared_memory_and_the_groups_back_stored(pipe):
    client, server, published = pipe.client, pipe.server, pipe.published
    state = {"a": torch.arange(6.0).view(2, 3), "b": torch.tensor([7], dtype=torch.int64)}
    shared = _publish(server, published, state, 0)
    ticket = client.acquire(-1, 2)
    assert (ticket.version, ticket.first, ticket.publish.fingerprint) == (0, 0, "prints of 0")
    held = ticket.publish.weights.state_dict
    assert held.keys() == state.keys() and all(torch.equal(held[k], state[k]) for k in state)
    shared.state_dict()["a"][0, 0] = 42.0  # the trainer's mapping and the worker's are the same memory
    assert held["a"][0, 0] == 42.0
    client.put(Finished([group(0), group(0)], ticket.first, None))
    assert server.core.in_flight == 0  # put as the ticket's holder (5), which answer_calls added
    taken, _ = server.take_ready(2, 0)
    assert [g.index for g in taken] == [0, 1] and all(isinstance(g, StoredGroup) for g in taken)


def test_a_look_reads_the_counter_and_asks_over_the_pipe_only_when_it_is_newer(pipe):
    client, server, published = pipe.client, pipe.server, pipe.published
    _publish(server, published, {"w": torch.zeros(2)}, 0)
    client.acquire(-1, 2)
    sent = client.conn.sent
    assert client.newer(0) is None and client.conn.sent == sent  # one memory read, no message
    _publish(server, published, {"w": torch.ones(2)}, 1)
    found = client.newer(0)
    assert client.conn.sent == sent + 1
    assert (found.version, found.fingerprint) == (1, "prints of 1")
    assert torch.equal(found.weights.state_dict["w"], torch.ones(2))


def test_the_pipe_answers_protocol_calls_only_and_returns_a_reported_error(pipe):
    pipe.client.conn.send(("error", "ValueError", "bad reward"))  # what a worker sends before it exits
    pipe.thread.join(timeout=30)
    assert pipe.answered == [("ValueError", "bad reward")]
    ours, theirs = multiprocessing.Pipe(duplex=True)
    theirs.send(("publish", {}, 3))
    with pytest.raises(ValueError, match=r"called 'publish': expected one of \['acquire', 'newer', 'put'\]"):
        answer_calls(ours, BufferServer(ReplayBufferCore(1, "wait", 2)), 5, os.getpid())
