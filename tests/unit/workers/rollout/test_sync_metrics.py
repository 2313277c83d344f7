"""The replay buffer reports each live rollout worker's latest weight load into its engine."""

import torch

from dppo.batch import Group
from dppo.workers.rollout.engines import WeightSync
from dppo.workers.rollout.replay_buffer import Finished, ReplayBufferCore, SyncCost


def _groups(count: int) -> list[Group]:
    return [
        Group(
            torch.zeros(3, dtype=torch.long),
            torch.zeros(2, 4, dtype=torch.long),
            torch.ones(2, 4, dtype=torch.bool),
            torch.zeros(2, 4),
            torch.zeros(2),
            0,
        )
        for _ in range(count)
    ]


def test_the_latest_load_of_each_live_worker_is_reported():
    buffer = ReplayBufferCore(1, "wait", 8)
    buffer.publish({"w": torch.zeros(1)}, 0)
    assert "rollout/weight_sync_bytes" not in buffer.stats()  # none reported yet (the hf engine never does)
    for holder, sync in ((0, WeightSync(0.5, 100, 0.25)), (1, WeightSync(0.2, 300, 0.75))):
        ticket = buffer.acquire(-1, 2, holder)
        buffer.put(Finished(_groups(2), ticket.first, sync), holder)
    stats = buffer.stats()
    assert stats["rollout/weight_sync_bytes"] == 400 and stats["timing_s/rollout_weight_sync"] == 0.5
    assert stats["rollout/weight_sync_changed_frac"] == 0.5
    ticket = buffer.acquire(0, 2, 0)
    buffer.put(Finished(_groups(2), ticket.first), 0)  # no load before this ticket: the last one stands
    assert buffer.stats()["rollout/weight_sync_bytes"] == 400
    buffer.release(1)  # worker 1 died: its loads no longer count
    assert buffer.stats()["rollout/weight_sync_bytes"] == 100


def test_the_check_of_each_load_is_reported_and_its_fingerprint_handed_out_with_the_weights():
    """rollout.verify_sync: the ticket that carries a version's weights carries their fingerprint (a ticket without
    weights none); timing_s/weight_sync_verify is the slowest live worker's latest check."""
    buffer = ReplayBufferCore(1, "wait", 8)
    buffer.publish({"w": torch.zeros(1)}, 0, fingerprint="prints of version 0")
    syncs = ((0, WeightSync(0.5, 100, 0.25, verify_seconds=0.125)), (1, WeightSync(0.2, 300, 0.75, verify_seconds=0.5)))
    for holder, sync in syncs:
        ticket = buffer.acquire(-1, 2, holder)
        assert (ticket.publish.version, ticket.publish.fingerprint) == (0, "prints of version 0")
        buffer.put(Finished(_groups(2), ticket.first, SyncCost.of(sync)), holder)
    assert buffer.acquire(0, 2, 0).publish is None  # holds version 0 already: no weights, nothing to check
    assert buffer.stats()["timing_s/weight_sync_verify"] == 0.5
    buffer.release(1)
    assert buffer.stats()["timing_s/weight_sync_verify"] == 0.125
    unchecked = ReplayBufferCore(1, "wait", 8)
    unchecked.publish({"w": torch.zeros(1)}, 0)
    ticket = unchecked.acquire(-1, 2, 0)
    unchecked.put(Finished(_groups(2), ticket.first, SyncCost.of(WeightSync(0.5, 100, 0.25))), 0)
    assert "timing_s/weight_sync_verify" not in unchecked.stats()  # rollout.verify_sync=false: no such timing


def test_an_engine_that_does_not_report_its_loads_still_reports_their_check():
    """The hf engine (RolloutEngine.reports_sync=False): its load's seconds and bytes stay out of the metrics, the
    worker's check of it (rollout.verify_sync) does not; unchecked, it reports nothing."""
    sync = WeightSync(0.5, 100, 1.0, verify_seconds=0.25)
    assert SyncCost.of(sync, load_reported=False) == SyncCost(None, None, None, 0.25)
    assert SyncCost.of(WeightSync(0.5, 100), load_reported=False) is None
    buffer = ReplayBufferCore(1, "wait", 8)
    buffer.publish({"w": torch.zeros(1)}, 0, fingerprint="prints of version 0")
    ticket = buffer.acquire(-1, 2, 0)
    buffer.put(Finished(_groups(2), ticket.first, SyncCost.of(sync, load_reported=False)), 0)
    stats = buffer.stats()
    assert stats["timing_s/weight_sync_verify"] == 0.25
    assert not {"timing_s/rollout_weight_sync", "rollout/weight_sync_bytes", "rollout/weight_sync_changed_frac"} & set(
        stats
    )
