"""The worker loop, written once: a rollout worker's calls to the replay buffer (BufferClient) and the loop over them.

run_ticket is one generation boundary, the same wherever the worker runs: acquire a ticket -> load the newer weights it
carries -> seed from its grant index -> generate -> put the groups back. run_tickets repeats it until the buffer stops
the worker. Neither knows how the calls travel; a BufferClient does, one per way:

    RayBufferClient (ray_worker.py)  a Ray actor's: calls on the buffer actor, the weights read from the object store
    PipeClient (process.py)          a local worker process's: calls over its pipe, the weights in shared memory
    InProcessClient (here)           trainer.mode=sync without Ray: ReplayBufferCore itself, in the trainer's process

A client hands the loop the weights resolved into what this process loads (worker.Weights) and the groups go back as
Finished, whole: a field added to Finished reaches the buffer's core without a change here or in any client.

rollout.partial_rollout: where the trainer may publish while a ticket generates (BufferClient.looks_mid_ticket), the
engine looks for newer weights once per decode chunk (its refresh): the client's newer, which never waits; a newer
publish is loaded mid-ticket and the unfinished responses go on under it. The ticket stays the one granted at its
start: its groups keep their start version (staleness counts their oldest token) and the wait budget is unchanged;
put reports the ticket's latest load.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from functools import partial

from dppo.workers.rollout.replay_buffer import Finished, Published, ReplayBufferCore, SyncCost, Ticket, map_weights
from dppo.workers.rollout.worker import RolloutGenerator, StateDictWeights


class BufferClient(abc.ABC):
    """A rollout worker's end of the replay buffer: the calls the worker loop makes."""

    # Whether the trainer may publish while a ticket generates (rollout.partial_rollout's looks are made only then).
    looks_mid_ticket: bool = False

    @abc.abstractmethod
    def acquire(self, version: int, num_groups: int) -> Ticket:
        """The next ticket for up to num_groups groups, waiting until the buffer grants one (stop=True: the buffer
        closed, or released this worker as dead); its publish, where newer than `version` (the one the worker holds),
        with the weights resolved into worker.Weights."""

    @abc.abstractmethod
    def newer(self, version: int) -> Published | None:
        """rollout.partial_rollout's look, once per decode chunk and never waiting: a publish newer than `version`
        (its weights resolved as acquire's), or None (none, or not known yet)."""

    @abc.abstractmethod
    def put(self, finished: Finished) -> None:
        """Hand the buffer a ticket's finished groups (Groups: a client that sends them to another process stores
        them, Finished.stored)."""


def run_ticket(client: BufferClient, generator: RolloutGenerator, num_groups: int) -> int:
    """One generation boundary: wait for a ticket of up to num_groups groups, load the newer weights it carries,
    generate its groups (drawn from trainer.seed and its grant index) and hand them back; the number made (0: the
    buffer stopped this worker). A failed weight sync check raises WeightSyncMismatchError (the worker is restarted)."""
    ticket = client.acquire(generator.version, num_groups)
    if ticket.stop:
        return 0
    loads = _TicketLoads(client, generator)
    if ticket.publish is not None:
        loads.load(ticket.publish)
    generator.seed_ticket(ticket.first)
    groups = generator.generate(ticket.num_groups, loads.look if client.looks_mid_ticket else None)
    client.put(Finished(groups, ticket.first, loads.latest, tuple(loads.mid_ticket)))
    return len(groups)


def run_tickets(client: BufferClient, generator: RolloutGenerator, num_groups: int) -> None:
    """A worker generating on its own (separate_async): tickets of up to num_groups groups until the buffer stops it."""
    while run_ticket(client, generator, num_groups):
        pass


class _TicketLoads:
    """A ticket's weight loads: the one at its start and rollout.partial_rollout's mid-ticket ones. latest: what the
    metrics get of the last (put reports it; None: none). mid_ticket: (look, version) of each mid-ticket load, look
    the 1-based count of the engine's looks so far (what the run's schedule records, and a replay loads at)."""

    def __init__(self, client: BufferClient, generator: RolloutGenerator) -> None:
        self.client, self.generator = client, generator
        self.latest: SyncCost | None = None
        self.looks = 0
        self.mid_ticket: list[tuple[int, int]] = []

    def load(self, published: Published) -> int:
        self.latest = self.generator.load(published)
        return published.version

    def look(self) -> Callable[[], int] | None:
        """The engine's refresh: the client's look for a newer publish; a loader of it (the engine calls it once it is
        done with the old weights; it returns the version loaded), or None."""
        self.looks += 1
        found = self.client.newer(self.generator.version)
        return None if found is None else partial(self._load_mid_ticket, self.looks, found)

    def _load_mid_ticket(self, look: int, published: Published) -> int:
        version = self.load(published)
        self.mid_ticket.append((look, version))
        return version


class InProcessClient(BufferClient):
    """trainer.mode=sync without Ray: the worker is in the trainer's process and generates between its steps, so it
    calls ReplayBufferCore directly and nothing can be published while a ticket generates. The weights are the
    trainer's own copy of what it published, the groups stay Groups."""

    def __init__(self, core: ReplayBufferCore) -> None:
        self.core = core

    def acquire(self, version: int, num_groups: int) -> Ticket:
        """RuntimeError where the buffer refuses (in sync mode it grants each trigger's groups at once)."""
        ticket = self.core.acquire(version, num_groups)
        if ticket is None:
            raise RuntimeError(f"replay buffer refused to grant groups in sync mode ({self.core.stats()})")
        return map_weights(ticket, StateDictWeights)

    def newer(self, version: int) -> Published | None:
        return None  # the trainer publishes between its steps, never while this process generates

    def put(self, finished: Finished) -> None:
        self.core.put(finished)
