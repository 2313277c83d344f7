"""The replay buffer reports each live rollout worker's latest weight load into its engine."""

import torch

from dppo.batch import Group
from dppo.workers.rollout.engines import WeightSync
from dppo.workers.rollout.replay_buffer import ReplayBufferCore


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
        buffer.put(_groups(2), ticket.first, holder, sync)
    stats = buffer.stats()
    assert stats["rollout/weight_sync_bytes"] == 400 and stats["timing_s/rollout_weight_sync"] == 0.5
    assert stats["rollout/weight_sync_changed_frac"] == 0.5
    ticket = buffer.acquire(0, 2, 0)
    buffer.put(_groups(2), ticket.first, 0, None)  # no load before this ticket: the last one stands
    assert buffer.stats()["rollout/weight_sync_bytes"] == 400
    buffer.release(1)  # worker 1 died: its loads no longer count
    assert buffer.stats()["rollout/weight_sync_bytes"] == 100
