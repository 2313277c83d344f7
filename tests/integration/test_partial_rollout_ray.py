"""rollout.partial_rollout on Ray: a rollout worker's look for newer weights (RolloutWorkerActor._refresh) against the
real replay-buffer actor. One call of the buffer's `newer` in flight, looked at without waiting; the weights are
loaded only when the buffer holds a newer version, and the ticket the worker holds is not touched. The worker's
engine is a recorder here: the look and what it hands the engine are under test, not the sampling."""

import pytest

from dppo.workers.rollout.replay_buffer import ReplayBufferActor
from dppo.workers.rollout.worker import RolloutWorkerActor

pytestmark = pytest.mark.integration


class _Core:
    """What the actor's look touches of its RolloutGenerator: the version it holds and load_published."""

    def __init__(self) -> None:
        self.version, self.loaded = 0, []

    def load_published(self, published, version):
        self.loaded.append((published, version))
        self.version = version
        return None


def test_a_workers_look_loads_a_newer_publish_mid_ticket_and_keeps_its_ticket(ray_cluster):
    import ray

    buffer = ray.remote(num_cpus=0)(ReplayBufferActor).remote(1, "wait", 4)
    worker = object.__new__(RolloutWorkerActor)  # its look only: no engine, no Ray actor of its own
    worker.buffer, worker.core, worker._poll, worker._sync = buffer, _Core(), None, None
    ray.get(buffer.publish.remote(["v0"], 0))
    ticket = ray.get(buffer.acquire.remote(-1, 4, "w"))
    assert (ticket.version, ticket.first, ticket.num_groups) == (0, 0, 4)
    assert worker._refresh() is None and worker._poll is not None  # the first look sends the call, waits for nothing
    ray.wait([worker._poll])  # answered (nothing newer): the next look reads it and sends the next call
    assert worker._refresh() is None and worker._poll is None
    assert worker._refresh() is None and worker._poll is not None
    ray.get(buffer.publish.remote(["v1"], 1))
    ray.wait([worker._poll])  # the call sent before the publish may have been answered before it: None
    load = worker._refresh()
    if load is None:  # it was: the next call sees version 1
        assert worker._refresh() is None
        ray.wait([worker._poll])
        load = worker._refresh()
    assert worker.core.loaded == [] and load is not None  # nothing loaded before the engine asks
    assert load() == 1 and worker.core.loaded == [(["v1"], 1)]
    # the ticket granted at version 0 is still the worker's: its groups go in at their grant index
    stats = ray.get(buffer.stats.remote())
    assert stats["replay/in_flight"] == 4.0
    ray.kill(buffer)
