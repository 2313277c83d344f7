"""A rollout source for tests that has only some of a cycle's later mini-batches ready at trigger 0, by count, not
by timing: what a real async run with a slow rollout sees, made deterministic (partial score-ahead)."""

from __future__ import annotations

from collections.abc import Iterable

from dppo.trainer.rollout import RolloutSource


class PartialRollout(RolloutSource):
    """Wraps a rollout source (InProcessRollout, or any RolloutSource). fetch passes through; fetch_ready
    (the trainer's score-ahead at a cycle's trigger 0, dppo.trainer.score_ahead.take_ready) finds only the number
    of groups that ready_per_cycle gives for that cycle "arrived": once they are used up it returns None, as a
    rollout still generating the next mini-batch would, and the trainer fetches the rest at their own triggers.

    ready_per_cycle: groups ready beyond trigger 0's own, one number per cycle (drawn at the cycle's first
    fetch_ready). The groups themselves, and their order, are the wrapped source's: only when they are taken
    changes.
    """

    def __init__(self, inner, ready_per_cycle: Iterable[int]) -> None:
        self.inner = inner
        self._schedule = iter(ready_per_cycle)
        self._ready: int | None = None  # groups fetch_ready may still take this cycle; None: not drawn yet
        self.ready_calls: list[bool] = []  # per fetch_ready call: whether it returned groups

    def published_weights(self):
        return self.inner.published_weights()

    def start(self) -> None:
        self.inner.start()

    def publish(self, weights, version: int) -> None:
        self.inner.publish(weights, version)

    def fetch(self, num_groups: int, trainer_version: int):
        self._ready = None  # trigger 0 fetches before it looks ahead: the next fetch_ready starts a new cycle's count
        return self.inner.fetch(num_groups, trainer_version)

    def fetch_ready(self, num_groups: int, trainer_version: int):
        if self._ready is None:
            self._ready = next(self._schedule)
        if self._ready < num_groups:
            self.ready_calls.append(False)
            return None
        self._ready -= num_groups
        self.ready_calls.append(True)
        return self.inner.fetch_ready(num_groups, trainer_version)

    def discard(self, count: int) -> None:
        self.inner.discard(count)

    def stats(self) -> dict[str, float]:
        return self.inner.stats()

    def describe(self) -> str:
        return self.inner.describe()

    @property
    def worker_restarts(self) -> int:
        return self.inner.worker_restarts

    def close(self) -> None:
        self.inner.close()


def record_slot_use(source) -> list:
    """From now on, the slot pi_old source (dppo.workers.actor.pi_old_sources.SlotSource) appends to the returned list
    "save" for each snapshot it takes into slot 0, and the trigger k of each old log-prob it computes at a trigger
    k >= 1, which is a read of slot 0 (its only way to score one there). A mini-batch scored ahead leaves no entry:
    its trigger never asks the source."""
    events, save, compute = [], source.pool.save, source.compute

    def saving(slot):
        events.append("save")
        return save(slot)

    def computing(trigger, batch):
        logp = compute(trigger, batch)
        if trigger > 0:
            events.append(trigger)
        return logp

    source.pool.save, source.compute = saving, computing
    return events
