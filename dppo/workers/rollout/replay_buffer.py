"""The replay buffer between rollout workers and the trainer, with staleness control.

Staleness of a group = trainer version when it is consumed - version of the policy that generated it.
Every group the trainer takes has staleness <= max_off_policy_threshold (eta): older groups are dropped.
How rollout is throttled depends on the strategy:

- wait: a worker may start generating only while the groups it would add keep every group consumable
  in time: with B = groups consumed per version, granted-and-not-dropped groups stay below
  (v + eta + 1) * B, v being the newest published version (the one the worker loads before it starts).
  The trainer takes groups in grant order (the k-th granted group is consumed at version k // B <= v + eta),
  waiting for a slow worker's older groups rather than taking a faster worker's newer ones ahead of them,
  so with any number of workers nothing is ever dropped.
- drop: workers generate freely up to (eta + 1) * B groups buffered or in flight; the trainer takes the
  oldest-granted groups that have arrived, and groups that are too old by then are dropped and counted.

Every ticket is recorded with the worker that holds it (its holder). When a worker dies, release(holder)
queues its outstanding tickets to be granted again, first, to whichever worker asks next, with the same
grant indices: the groups it was generating are generated anew, none is lost and none is taken twice (a
late put from the dead holder is refused, and so is anything it asks for afterwards).

ReplayBufferCore is the plain logic (used in-process and by tests); buffer_server.BufferServer serves it to worker
processes and the trainer, waiting where the core says "not yet" (the Ray actor, and the local workers' pipes).
ReplayBufferCore.take never waits (None: not all there yet); the server's take waits and its take_ready does not
(the trainer's score-ahead takes a cycle's later mini-batches that have already arrived). What travels between a
worker and the buffer is one dataclass each way: a Ticket (with the Published weights it carries) to the worker,
Finished (its groups and what its weight loads cost) back.

discard(count): the trainer took count groups it will not train on (algorithm.filter_groups dropped them). Under
wait they free their place in the budget as dropped ones do: the budget counts the groups the trainer trains on, B
per version, and a trainer that takes more than B groups a version would otherwise wait for groups never granted.

The core holds whatever has a version and an index (Group in-process). The buffer's Ray process never imports torch:
that import costs a process about 290 MB and two CPU-seconds at every start. Rollout workers put StoredGroups (numpy
arrays) and SyncCosts there, and the trainer turns what it takes back into Groups (Group.from_arrays).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # the module must not import torch (dppo.batch does)
    from dppo.batch import Group


@dataclass
class StoredGroup:
    """A group as the replay buffer's Ray process holds it: Group.to_arrays()'s fields, numpy arrays where the Group has
    tensors. version and index as the Group's (the buffer reads the one and sets the other)."""

    arrays: dict[str, Any]
    version: int
    index: int = -1
    ticket: dict | None = None  # as Group.ticket: set by the buffer's put

    @classmethod
    def of(cls, group: Group) -> StoredGroup:
        return cls(group.to_arrays(), group.version)


@dataclass(frozen=True)
class SyncCost:
    """What the buffer keeps of a rollout engine's WeightSync (the class itself lives with the engines, which import
    torch): the seconds, bytes and changed fraction of one weight load, None where the engine does not report its
    loads (the hf engine: RolloutEngine.reports_sync), and the seconds of the worker's check of it."""

    seconds: float | None
    bytes: int | None
    changed_fraction: float | None
    verify_seconds: float | None = None  # its check (rollout.verify_sync); None: not checked

    @classmethod
    def of(cls, sync, load_reported: bool = True) -> SyncCost | None:
        """sync's numbers (a WeightSync; None: no load); load_reported=False: its check's seconds alone (None where it
        was not checked either)."""
        if sync is None:
            return None
        verify_s = None if sync.verify_seconds is None else float(sync.verify_seconds)
        if not load_reported:
            return None if verify_s is None else cls(None, None, None, verify_s)
        return cls(float(sync.seconds), int(sync.bytes), float(sync.changed_fraction), verify_s)


@dataclass(frozen=True)
class Published:
    """Weights the trainer published, as a ticket or a look (newer) hands them to a worker."""

    version: int
    weights: Any  # what ReplayBufferCore.publish got; a worker's buffer client resolves it into what it loads
    fingerprint: Any = None  # their WeightFingerprint (rollout.verify_sync), checked after the load; None: not checked


@dataclass(frozen=True)
class Ticket:
    """A worker's permission to generate num_groups groups, with weights to load first (if newer)."""

    num_groups: int
    version: int  # the version the worker generates with (after loading `publish`)
    publish: Published | None = None  # None: keep the current weights
    stop: bool = False
    first: int = 0  # grant index of the ticket's first group; the worker hands it back with the groups (put)


def publish_in(answer: Ticket | Published | None) -> Published | None:
    """The publish a worker's call brought back, if any: a ticket's (acquire), or newer's own."""
    return answer.publish if isinstance(answer, Ticket) else answer


def map_weights(answer: Ticket | Published | None, convert: Callable[[Any], Any]) -> Ticket | Published | None:
    """answer (as publish_in's) with the weights of its publish replaced by convert(them): what they are where they
    travel (a shared-memory file's layout on a pipe) or what a worker's process loads (worker.Weights)."""
    publish = publish_in(answer)
    if publish is None:
        return answer
    publish = dataclasses.replace(publish, weights=convert(publish.weights))
    return dataclasses.replace(answer, publish=publish) if isinstance(answer, Ticket) else publish


@dataclass
class Finished:
    """What a worker hands back for a ticket (put): the groups, those of grant indices first, first + 1, ... in order,
    and what the worker's engine paid for the ticket's latest weight load (None: it loaded none)."""

    groups: list  # Groups; StoredGroups where they travel to another process (stored())
    first: int
    sync: SyncCost | None = None
    # rollout.partial_rollout's mid-ticket loads: (the engine's look that loaded them, 1-based; their version)
    looks: tuple[tuple[int, int], ...] = ()

    def stored(self) -> Finished:
        """These groups as the replay buffer's process holds them (StoredGroup: numpy arrays, no torch)."""
        return dataclasses.replace(self, groups=[StoredGroup.of(g) for g in self.groups])


class ReplayBufferCore:
    def __init__(
        self,
        max_off_policy_threshold: int,
        strategy: str,
        groups_per_version: int,
        start_version: int = 0,
        *,
        start_consumed: int | None = None,
        start_grant: int | None = None,
        start_dropped: int = 0,
    ):
        """start_consumed: groups consumed before this buffer (default: every version before start_version fully,
        start_version * groups_per_version); start_grant: grant index of its first group (default: start_consumed);
        start_dropped: groups dropped before it (dropped_total goes on from there)."""
        if strategy not in ("drop", "wait"):
            raise ValueError(f"replay.max_off_policy_strategy must be 'drop' or 'wait'; got {strategy!r}")
        self.threshold = max_off_policy_threshold
        self.strategy = strategy
        self.groups_per_version = groups_per_version
        self.groups: dict[int, Group] = {}  # grant index -> a finished group not yet taken or dropped
        self.version = start_version  # newest published trainer version
        self.weights: Any = None
        self.fingerprint: Any = None  # the published weights' WeightFingerprint (None: not verified)
        self.closed = False
        consumed = start_version * groups_per_version if start_consumed is None else start_consumed
        self.granted = consumed if start_grant is None else start_grant  # the grant index of the next new group
        self.next_take = self.granted  # wait: grant index of the next group the trainer takes
        # wait: the group of grant index i is the (i + _order_offset)-th the trainer consumes (before drops)
        self._order_offset = consumed - self.granted
        self._tickets: dict[int, tuple[int, Any]] = {}  # first grant index -> (group count, holder), not yet put
        self._regrants: list[tuple[int, int]] = []  # (first, count) of dead holders' tickets, granted again first
        self._dead: set = set()  # holders released as dead
        self._syncs: dict = {}  # holder -> its latest SyncCost
        self.regranted_total = 0
        self.dropped_total = start_dropped
        self._dropped_before = start_dropped
        self._dropped_since_take = 0
        self.discarded_total = 0  # taken groups the trainer does not train on (discard), since this buffer started

    # ---- trainer side ----------------------------------------------------------------------------

    def publish(self, weights: Any, version: int, fingerprint: Any = None) -> None:
        """New weights for the workers; the trainer is now at this version. fingerprint: the weights' WeightFingerprint,
        handed out with them for the workers to check their loads against (None: not checked)."""
        if version < self.version or (version == self.version and self.weights is not None):
            raise ValueError(f"published version {version} is not newer than the current version {self.version}")
        self.weights, self.version, self.fingerprint = weights, version, fingerprint

    def take(self, num_groups: int, trainer_version: int) -> tuple[list[Group], int] | None:
        """Pop num_groups groups no staler than the threshold, with the number dropped since the last take;
        None if they are not all there yet (nothing is popped). wait: the next ones in grant order; drop: the
        oldest-granted ones buffered, after dropping every stale group."""
        take = self._take_in_grant_order if self.strategy == "wait" else self._take_oldest_buffered
        indices = take(num_groups, trainer_version)
        if indices is None:
            return None
        taken = [self.groups.pop(i) for i in indices]
        dropped, self._dropped_since_take = self._dropped_since_take, 0
        return taken, dropped

    def _stale(self, index: int, trainer_version: int) -> bool:
        return trainer_version - self.groups[index].version > self.threshold

    def _take_in_grant_order(self, num_groups: int, trainer_version: int) -> list[int] | None:
        """Grant indices of the next num_groups fresh groups from next_take on, dropping stale ones passed over
        (none under the wait budget); None while one of them is still being generated."""
        fresh, end = [], self.next_take
        while len(fresh) < num_groups:
            if end not in self.groups:
                return None  # an earlier grant is still in flight: wait for it instead of passing it by
            if not self._stale(end, trainer_version):
                fresh.append(end)
            end += 1
        for index in set(range(self.next_take, end)) - set(fresh):
            del self.groups[index]
            self._drop()
        self.next_take = end
        return fresh

    def _take_oldest_buffered(self, num_groups: int, trainer_version: int) -> list[int] | None:
        """Drop every stale buffered group; grant indices of the num_groups oldest-granted others, or None."""
        for index in [i for i in self.groups if self._stale(i, trainer_version)]:
            del self.groups[index]
            self._drop()
        if len(self.groups) < num_groups:
            return None
        return sorted(self.groups)[:num_groups]

    def discard(self, count: int) -> None:
        """The trainer took count groups it does not train on (algorithm.filter_groups): under wait they free budget."""
        if count < 0:
            raise ValueError(f"discard of {count} groups: expected a count >= 0")
        self.discarded_total += count

    def close(self) -> None:
        """Stop the workers: every pending and later acquire gets a stop ticket."""
        self.closed = True

    def newer(self, worker_version: int) -> Published | None:
        """rollout.partial_rollout: the newest publish where it is newer than worker_version, else None (also once
        closed). Grants nothing: the worker's ticket stays the one it holds. A mid-ticket load is checked against the
        fingerprint as a ticket's is (rollout.verify_sync)."""
        if self.closed or self.weights is None or self.version <= worker_version:
            return None
        return self._published()

    def _published(self) -> Published:
        return Published(self.version, self.weights, self.fingerprint)

    # ---- worker side -----------------------------------------------------------------------------

    def grantable(self) -> int:
        """Groups a worker may start generating now (0: it must wait)."""
        if self.strategy == "wait":
            budget = (self.version + self.threshold + 1) * self.groups_per_version
            counted = (
                self.granted + self._order_offset - (self.dropped_total - self._dropped_before) - self.discarded_total
            )
            return max(0, budget - counted)
        return max(0, (self.threshold + 1) * self.groups_per_version - len(self.groups) - self.in_flight)

    def acquire(self, worker_version: int, num_groups: int, holder: Any = None) -> Ticket | None:
        """A ticket for up to num_groups groups (a dead holder's re-granted ones first), a stop ticket once closed
        or if holder was released as dead, or None if the worker must wait."""
        if self.closed or holder in self._dead:
            return Ticket(0, worker_version, stop=True)
        if self.weights is None:
            return None  # nothing published yet: no weights to generate with
        if self._regrants:
            first, count = self._regrants[0]
            granted = min(num_groups, count)
            self._regrants[0:1] = [(first + granted, count - granted)] if granted < count else []
        else:
            granted = min(num_groups, self.grantable())
            if granted == 0:
                return None
            first, self.granted = self.granted, self.granted + granted
        self._tickets[first] = (granted, holder)
        publish = self._published() if self.version > worker_version else None
        return Ticket(granted, self.version, publish, first=first)

    def put(self, finished: Finished, holder: Any = None) -> None:
        """holder's finished groups: those of its ticket whose first grant index is finished.first, in order. Their
        sync (what holder's engine paid for the weights it loaded before or while generating them), if it loaded
        any: stats() reports the latest one of each live holder."""
        groups, first = finished.groups, finished.first
        if self._tickets.get(first) != (len(groups), holder):
            raise ValueError(
                f"put of {len(groups)} groups at grant index {first} by holder {holder!r}: no outstanding "
                f"ticket granted those to it (outstanding: {self._tickets})"
            )
        del self._tickets[first]
        if finished.sync is not None:
            self._syncs[holder] = finished.sync
        # what generated them, for the run's schedule (Group.ticket): enough to generate them again
        looks = [[int(look), int(version)] for look, version in finished.looks]
        ticket = {"first": first, "size": len(groups), "version": int(groups[0].version) if groups else -1}
        for index, group in enumerate(groups, first):
            group.index = index
            group.ticket = {**ticket, "looks": [list(pair) for pair in looks]}
            self.groups[index] = group

    def release(self, holder: Any) -> int:
        """holder died: grant its outstanding tickets again (same grant indices) and refuse it from now on; the
        number of groups to be generated anew."""
        self._dead.add(holder)
        self._syncs.pop(holder, None)
        mine = sorted(first for first, (_, owner) in self._tickets.items() if owner == holder)
        regranted = [(first, self._tickets.pop(first)[0]) for first in mine]
        self._regrants = sorted(self._regrants + regranted)
        count = sum(n for _, n in regranted)
        self.regranted_total += count
        return count

    @property
    def in_flight(self) -> int:
        """Groups granted and not yet put (re-granted ones waiting for a worker included)."""
        return sum(n for n, _ in self._tickets.values()) + sum(n for _, n in self._regrants)

    def _drop(self) -> None:
        self.dropped_total += 1
        self._dropped_since_take += 1

    def stats(self) -> dict[str, float]:
        stats = {
            "replay/size": float(len(self.groups)),
            "replay/in_flight": float(self.in_flight),
            "replay/dropped_total": float(self.dropped_total),
            "replay/regranted_total": float(self.regranted_total),
        }
        syncs = list(self._syncs.values())  # each live worker's latest weight load into its engine (once a cycle)
        loads = [s for s in syncs if s.seconds is not None]  # of engines that report their loads (not hf)
        if loads:
            stats["timing_s/rollout_weight_sync"] = max(float(s.seconds) for s in loads)
            stats["rollout/weight_sync_bytes"] = float(sum(s.bytes for s in loads))
            stats["rollout/weight_sync_changed_frac"] = float(np.mean([s.changed_fraction for s in loads]))
        verified = [float(s.verify_seconds) for s in syncs if s.verify_seconds is not None]
        if verified:  # rollout.verify_sync: the check after each load (read back, checksummed, compared), any engine
            stats["timing_s/weight_sync_verify"] = max(verified)
        return stats
