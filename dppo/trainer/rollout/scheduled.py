"""A rollout that follows a run's schedule (dppo.trainer.schedule): what `dppo replay` trains with.

ScheduledRollout answers the trainer's takes exactly as the run's rollout did, in the same order: the same groups at
the same triggers, the same score-ahead looks that found their groups there or not, the same counts dropped as too
stale. It generates each ticket the takes name once, in this process, when its first group is taken:

    load the ticket's start version  ->  seed it from (trainer.seed, its first grant index)  ->  generate its groups,
    loading each mid-ticket version at the look the run's worker loaded it (rollout.partial_rollout)

with rollout.num_threads threads where the run's workers had processes of their own, as they did. The versions a ticket
may need (no older than the staleness bound, replay.max_off_policy_threshold, lets a taken group be) are kept in the
slots of a snapshot pool (dppo.snapshot), one per version of that window: a publish is saved into its slot, a ticket's
version is read from it. The process's random states are left as they were (the trainer's, which the run's workers
never touched).

With samples (trainer.record_samples' files) nothing is generated: each take gets the groups the run trained on.

A take the replay asks for that is not the run's next one (another call, count or version) is ScheduleError naming
the step and the trigger: the replay no longer follows the run (a setting that changes the schedule, or a schedule
edited by hand).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import ray
import torch

from dppo.batch import Group
from dppo.lora import LoraPublish
from dppo.models import as_state_dict
from dppo.snapshot import SnapshotPool
from dppo.config import DppoConfig
from dppo.data.source import PromptSource
from dppo.trainer.rollout.common import cloned_state, published_copy
from dppo.trainer.rollout.settings import worker_settings
from dppo.trainer.rollout.source import RolloutSource
from dppo.trainer.schedule import (
    SAMPLES_DIR,
    Schedule,
    ScheduleError,
    Take,
    read_samples,
    samples_name,
    switch_token,
)
from dppo.workers.rollout.replay_buffer import Published
from dppo.workers.rollout.worker import RolloutGenerator, StateDictWeights, ticket_seeds


class VersionSlots:
    """The published versions a replayed ticket may still need, each in a slot of one snapshot pool: version v in slot
    v % capacity (capacity: the staleness window, max_off_policy_threshold + 1). A LoRA policy's slots hold its
    adapter, the base kept once."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.pool: SnapshotPool | None = None
        self._staging: dict[str, torch.Tensor] = {}  # the tensors the pool snapshots (one per storage)
        self._names: dict[str, str] = {}  # every published name -> its tensor's name in _staging (tied ones: one)
        self._held: dict[int, int] = {}  # slot -> version it holds
        self._lora: LoraPublish | None = None  # the latest LoRA publish: the base, scaling and spec of every version

    def keep(self, version: int, weights) -> None:
        """weights (a state dict, or a LoRA publish) as `version`, in its slot (replacing the version capacity older)."""
        if isinstance(weights, LoraPublish):
            self._lora, tensors = weights, weights.adapter
        else:
            tensors = weights
        if self.pool is None:
            self._layout(tensors)
        for name, tensor in tensors.items():
            self._staging[self._names[name]].copy_(tensor)
        slot = version % self.capacity
        self.pool.save(slot)
        self.pool.synchronize()  # the staging tensors are written again at the next publish
        self._held[slot] = version

    def _layout(self, tensors: dict[str, torch.Tensor]) -> None:
        clones = cloned_state(tensors)  # tied tensors stay one
        first: dict[int, str] = {}
        for name, tensor in clones.items():
            self._names[name] = first.setdefault(id(tensor), name)
        self._staging = {name: clones[name] for name in first.values()}
        self.pool = SnapshotPool(self._staging)

    def weights(self, version: int):
        """What `version` was published as (a state dict on the slot's memory, or a LoRA publish of its adapter).
        ScheduleError where the slot holds another version: the ticket needs one older than the window."""
        slot = version % self.capacity
        if self._held.get(slot) != version:
            raise ScheduleError(
                f"a ticket needs version {version}, which is no longer held (slot {slot} holds "
                f"{self._held.get(slot)}; the window is {self.capacity} versions, replay.max_off_policy_threshold + 1)"
            )
        view = self.pool.view(slot)
        tensors = {name: view[staged] for name, staged in self._names.items()}
        return tensors if self._lora is None else dataclasses.replace(self._lora, adapter=tensors)


def plain_weights(weights):
    """What a rank published, as this process holds it: a Ray rank's [ObjectRef, (a delta,) (a fingerprint)] read from
    the object store (a state dict, or a LoRA publish)."""
    if isinstance(weights, list) and weights and isinstance(weights[0], ray.ObjectRef):
        fetched = ray.get(weights[0])
        return fetched if isinstance(fetched, LoraPublish) else as_state_dict(fetched)
    return weights


@contextlib.contextmanager
def _as_a_worker(threads: int) -> Iterator[None]:
    """Generate as a worker process would: its torch threads, and this process's random states untouched."""
    before = torch.get_num_threads()
    states = torch.random.get_rng_state(), np.random.get_state(), random.getstate()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
        torch.random.set_rng_state(states[0])
        np.random.set_state(states[1])
        random.setstate(states[2])


class _ScriptedLooks:
    """A ticket's refresh (rollout.partial_rollout) that loads each recorded version at the look the run's worker
    loaded it, counting the engine's looks as the worker did (buffer_client._TicketLoads)."""

    def __init__(self, looks: list[list[int]], load: Callable[[int], int]) -> None:
        self.looks, self.load, self.count = {int(k): int(v) for k, v in looks}, load, 0

    def __call__(self) -> Callable[[], int] | None:
        self.count += 1
        version = self.looks.pop(self.count, None)
        return None if version is None else (lambda: self.load(version))


class ScheduledRollout(RolloutSource):
    """The rollout of a run's schedule (see the module docstring)."""

    def __init__(
        self,
        cfg: DppoConfig,
        source: PromptSource,
        model_config,
        schedule: Schedule,
        samples: Path | None = None,
    ) -> None:
        """cfg: the replay's config (the run's, with the replay's overrides); schedule: the run's, read; samples: the
        run's samples directory (replay --samples: its groups are the takes'), or None (generate them)."""
        self.schedule = schedule
        self._position = 0  # the run's next take to follow
        self._stream: list[Group] = []  # --samples: the groups of the takes begun, not yet handed out
        self._samples = Path(samples) if samples is not None else None
        self._sample_groups: dict[tuple[int, int], list[Group]] = {}
        self.versions = VersionSlots(min(cfg.replay.max_off_policy_threshold, cfg.trainer.total_steps) + 1)
        self.generator = None
        if samples is None:
            self.generator = RolloutGenerator(worker_settings(cfg, source, model_config), source, model_config, 0)
        # the run's workers: processes of their own (rollout.num_threads threads) that looked for newer weights
        # mid-ticket, or (trainer.mode=sync without Ray) the trainer's process between its steps
        own_process = cfg.use_ray or cfg.trainer.mode == "separate_async"
        self._threads = cfg.rollout.num_threads if own_process else cfg.trainer.num_threads
        self._looked = cfg.trainer.mode == "separate_async"
        self._generated: dict[int, dict[int, Group]] = {}  # ticket -> its groups still to be taken
        self._published = None
        self.dropped_total = 0
        self.tickets_generated = 0

    # ---- the trainer's side -------------------------------------------------------------------------------------

    @property
    def worker_restarts(self) -> int:
        return 0

    def start(self) -> None:
        pass

    def publish(self, weights, version: int) -> None:
        weights = plain_weights(weights)
        self.versions.keep(version, weights)
        self._published = (version, published_copy(weights))

    def published_weights(self) -> dict[str, torch.Tensor]:
        return as_state_dict(self._published[1])

    def fetch(self, num_groups: int, trainer_version: int) -> tuple[list[Group], int]:
        return self._take("fetch", num_groups, trainer_version)

    def fetch_ready(self, num_groups: int, trainer_version: int) -> tuple[list[Group], int] | None:
        return self._take("ready", num_groups, trainer_version)

    def discard(self, count: int) -> None:
        pass  # nothing runs ahead: the schedule says what was taken

    def stats(self) -> dict[str, float]:
        return {"replay/dropped_total": float(self.dropped_total), "rollout/worker_restarts": 0.0}

    def describe(self) -> str:
        how = f"the samples in {self._samples}" if self._samples else "generated in this process"
        return f"rollout: the schedule of {self.schedule.path} ({len(self.schedule.takes)} takes), {how}"

    def close(self) -> None:
        if self.generator is not None:
            self.generator.close()

    # ---- the takes ----------------------------------------------------------------------------------------------

    def _peek(self) -> Take | None:
        """The run's next take, not yet followed (None: past its last)."""
        takes = self.schedule.takes
        return takes[self._position] if self._position < len(takes) else None

    def _take(self, call: str, num_groups: int, version: int) -> tuple[list[Group], int] | None:
        if self._samples is not None:
            return self._take_samples(call, num_groups)
        take, asked = self._peek(), f"{call} of {num_groups} group(s) at version {version}"
        if take is None:
            raise ScheduleError(f"the replay asks for a {asked} after the schedule's last take ({self.schedule.path})")
        if (take.call, take.want, take.version) != (call, num_groups, version):
            raise ScheduleError(
                f"{take.where()}: the replay asks for a {asked}, the run made a {take.call} of {take.want} at version "
                f"{take.version}: the replay no longer follows the run's schedule (a setting that changes it, or an "
                "edited schedule)"
            )
        self._position += 1
        if take.groups is None:
            return None
        self.dropped_total += take.dropped
        return [self._group(i, f) for i, f in take.groups], take.dropped

    def _take_samples(self, call: str, num_groups: int) -> tuple[list[Group], int] | None:
        """--samples: the run's groups in the order it took them, num_groups at a time. Its looks ahead are followed
        where the replay looks too (a look that found nothing finds nothing); a replay whose settings look where the
        run did not (another prox method: score-ahead or not) finds nothing there and takes those groups at their
        triggers, and one that does not look where the run did takes them all the same: each trigger trains on the
        run's groups."""
        while (take := self._peek()) is not None and take.call == "ready" and take.groups is None:
            self._position += (
                1  # the run looked and found nothing: so does a replay that looks; one that does not, skips it
            )
            if call == "ready":
                return None
        if call == "ready" and not self._stream and (take is None or take.call != "ready"):
            return None
        groups, dropped = [], 0
        while len(groups) < num_groups:
            if not self._stream:
                take = self._peek()
                if take is None:
                    raise ScheduleError(f"the replay asks for more groups than the run took ({self._samples})")
                self._position += 1
                if take.groups is None:
                    continue
                self._stream.extend(self._recorded(take))
                dropped += take.dropped
            groups.append(self._stream.pop(0))
        self.dropped_total += dropped
        return groups, dropped

    def _recorded(self, take: Take) -> list[Group]:
        """take's groups from the run's samples of its trigger (its file holds the trigger's takes' groups in order)."""
        key = (take.step, take.trigger)
        if key not in self._sample_groups:
            self._sample_groups = {key: read_samples(self._samples / samples_name(*key))}
        stored = self._sample_groups[key]
        groups, stored[:] = stored[: len(take.groups)], stored[len(take.groups) :]
        indices = [g.index for g in groups]
        if indices != [i for i, _ in take.groups]:
            raise ScheduleError(
                f"{take.where()}: the samples in {self._samples} hold groups {indices}, the schedule took "
                f"{[i for i, _ in take.groups]}"
            )
        return groups

    def _group(self, index: int, first: int | None) -> Group:
        if first is None:
            raise ScheduleError(
                f"group {index} came from no ticket (not through a replay buffer): it cannot be generated"
            )
        if first not in self._generated:
            self._generated[first] = self._generate(self.schedule.tickets[first])
        groups = self._generated[first]
        group = groups.pop(index)
        if not groups:
            del self._generated[first]
        return group

    def _generate(self, ticket: dict) -> dict[int, Group]:
        """The ticket's groups, generated as the run's worker did; those the schedule takes, by grant index."""
        first, size = int(ticket["first"]), int(ticket["size"])
        seeds = list(ticket_seeds(self.schedule.seed, first))
        if seeds != list(ticket["seed"]):
            raise ScheduleError(
                f"ticket {first}: its seeds {ticket['seed']} are not those of trainer.seed={self.schedule.seed}"
            )
        generator = self.generator
        with _as_a_worker(self._threads):
            self._load(int(ticket["version"]))
            generator.seed_ticket(first)
            looks = _ScriptedLooks(ticket["looks"], self._load)
            made = generator.generate(size, looks if self._looked else None)
        if looks.looks:
            raise ScheduleError(
                f"ticket {first}: the engine looked {looks.count} time(s); the run loaded versions at looks "
                f"{sorted(looks.looks)} it never reached"
            )
        self.tickets_generated += 1
        out = {}
        for index, group in enumerate(made, first):
            group.index, group.ticket = index, {key: ticket[key] for key in ("first", "size", "version", "looks")}
            if index in self.schedule.taken.get(first, ()):
                out[index] = group
        self._check_switches(ticket, list(out.values()))
        return out

    def _load(self, version: int) -> int:
        if self.generator.version != version:
            self.generator.load(Published(version, StateDictWeights(self.versions.weights(version))))
        return version

    @staticmethod
    def _check_switches(ticket: dict, groups: list[Group]) -> None:
        """Each recorded switch's token index is where the replayed responses switch too."""
        for token, version in ticket.get("switches", []):
            replayed = switch_token(groups, version)
            if token is not None and replayed != token:
                raise ScheduleError(
                    f"ticket {ticket['first']}: version {version} sampled from token {replayed} in the replay, from "
                    f"token {token} in the run"
                )


def samples_dir(run_dir: Path) -> Path:
    return Path(run_dir) / SAMPLES_DIR
