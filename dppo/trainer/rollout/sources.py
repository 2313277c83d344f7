"""Where the trainer's groups come from: Ray rollout workers (async or lockstep), local worker processes
(dppo.trainer.rollout.local) or an in-process generator.

Both sources run the same worker step (ticket from the replay buffer -> load newer weights -> generate -> put)
and the same replay-buffer logic; they differ only in who runs the step and when. fetch(num_groups, version)
waits for a trigger's groups; fetch_ready takes them only if they have arrived (the trainer's score-ahead, at
a cycle's first trigger), and in sync mode generates them at once.

On Ray, a rollout worker whose process dies is restarted (up to rollout.max_restarts times per worker) and
the replay buffer grants its outstanding tickets again, so the groups it was generating are generated anew
(rollout/worker_restarts counts the restarts). Anything the rollout cannot recover from (the replay buffer
died, a worker's restarts are used up, a worker raised) is one RolloutFailedError naming what died.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch
from ray.exceptions import GetTimeoutError, RayTaskError

from dppo._text import one_line
from dppo.data.source import PromptSource
from dppo.models import as_state_dict
from dppo.batch import Group
from dppo.trainer.actor_deaths import death_in_words, process_gone_errors
from dppo.trainer.placement import bundle_options, place_pool, plan, pools, remove_pool
from dppo.checkpoint.state import RolloutStart
from dppo.trainer.rollout.local import LocalRollout
from dppo.trainer.rollout.common import RolloutFailedError, buffer_core, cloned_state, groups_of
from dppo.workers.rollout.replay_buffer import ReplayBufferActor
from dppo.workers.rollout.worker import RolloutGenerator, RolloutWorkerActor

log = logging.getLogger("dppo.batch")

BUFFER_TIMEOUT_S = 30.0  # how long a liveness check waits for the replay buffer to answer


class InProcessRollout:
    """trainer.mode=sync without Ray: generate each trigger's groups in this process, then take them."""

    worker_restarts = 0

    def __init__(self, cfg, source: PromptSource, model_config, start: RolloutStart):
        self.buffer = buffer_core(cfg, start)
        self.worker = RolloutGenerator(cfg, source, model_config, 0)

    def start(self) -> None:
        pass

    def publish(self, state_dict, version: int) -> None:
        """A copy of state_dict (the rank's CPU state dict: the live tensors, which the cycle's steps move) is what the
        worker loads at its next ticket and what published_weights() gives back."""
        self._published = cloned_state(state_dict)
        self.buffer.publish(self._published, version)

    def published_weights(self) -> dict[str, torch.Tensor]:
        """The weights of the last publish, exactly as published (the model's dtype)."""
        return self._published

    def fetch(self, num_groups: int, trainer_version: int) -> tuple[list[Group], int]:
        """(groups, groups dropped since the last fetch)."""
        made = 0
        while made < num_groups:
            ticket = self.buffer.acquire(self.worker.version, num_groups - made)
            if ticket is None:
                raise RuntimeError(f"replay buffer refused to grant groups in sync mode ({self.buffer.stats()})")
            sync = None
            if ticket.weights is not None:
                sync = self.worker.load_weights(ticket.weights, ticket.version)
            self.worker.seed_ticket(ticket.first)
            self.buffer.put(self.worker.generate(ticket.num_groups), ticket.first, None, sync)
            made += ticket.num_groups
        result = self.buffer.take(num_groups, trainer_version)
        assert result is not None, "groups generated for this trigger must be takeable"
        return result

    def fetch_ready(self, num_groups: int, trainer_version: int) -> tuple[list[Group], int] | None:
        """fetch, without waiting for a rollout running ahead; sync mode has none, so it generates the groups now
        (the same ones: a ticket is seeded by its grant index, and the weights stay those of the cycle start)."""
        return self.fetch(num_groups, trainer_version)

    def discard(self, count: int) -> None:
        """The trainer took count groups it does not train on (algorithm.filter_groups; ReplayBufferCore.discard)."""
        self.buffer.discard(count)

    def stats(self) -> dict[str, float]:
        return {**self.buffer.stats(), "rollout/worker_restarts": 0.0}

    def close(self) -> None:
        self.buffer.close()


@dataclass
class _Worker:
    """One incarnation of rollout worker `index`."""

    index: int
    holder: int  # its id at the replay buffer
    actor: Any
    restarts: int = 0  # how often worker `index` was restarted before this incarnation
    run: Any = None  # the ObjectRef of its run() loop (separate_async)


class RayRollout:
    """Rollout workers and the replay buffer as Ray actors.

    separate_async: each worker loops on its own, the trainer only takes from the buffer.
    sync: the trainer asks the workers for exactly the groups of each trigger, then takes them.
    """

    def __init__(self, cfg, source: PromptSource, model_config, start: RolloutStart):
        self.cfg, self.mode = cfg, cfg.trainer.mode
        self.worker_restarts = start.worker_restarts
        # GPU workers: one bundle each in the rollout's own placement groups (a restarted worker takes its
        # predecessor's); CPU workers (no pool): spread over the nodes, reserving nothing.
        self._pool = pools(cfg)[1]
        self._groups = place_pool(self._pool, plan(cfg).rollout_nodes) if self._pool is not None else []
        self.buffer = buffer_core(cfg, start, ray.remote(num_cpus=0)(ReplayBufferActor).remote)
        self._worker_cls = ray.remote(num_cpus=0)(RolloutWorkerActor)
        # The PromptSource object itself goes to the workers (cloudpickle carries lambdas and closures): a worker
        # process has only the built-in tasks registered, so looking task.name up there would miss a
        # register_task one; text data arrives tokenized, with the tokenizer and the reward function.
        self._worker_args = (ray.put(source), model_config)
        self._holders = itertools.count()
        self._running = False
        self.workers = [self._spawn(i) for i in range(cfg.rollout.num_workers)]

    def _spawn(self, index: int, restarts: int = 0) -> _Worker:
        source_ref, model_config = self._worker_args
        holder = next(self._holders)
        options = {"scheduling_strategy": "SPREAD"} if self._pool is None else \
            bundle_options(self._pool, self._groups, index)  # fmt: skip
        actor = self._worker_cls.options(**options).remote(self.cfg, source_ref, model_config, index, self.buffer, holder)
        worker = _Worker(index, holder, actor, restarts)
        if self._running:
            worker.run = actor.run.remote()
        return worker

    def start(self) -> None:
        if self.mode == "separate_async":
            self._running = True
            for worker in self.workers:
                worker.run = worker.actor.run.remote()

    def publish(self, weights, version: int) -> None:
        """weights: [ObjectRef] of a state dict already in the object store (the actor's rank 0 put it there),
        or a state dict, put here once. The buffer hands the reference to each worker at its next boundary."""
        refs = weights if isinstance(weights, list) else [ray.put(weights)]  # rank 0 put them there, or one put here
        self._published = refs
        self._from_buffer(self.buffer.publish.remote(refs, version))

    def published_weights(self) -> dict[str, torch.Tensor]:
        """The weights of the last publish, read back from the object store (their owner, the actor's rank 0 or this
        process, keeps them there after a worker or the buffer died)."""
        return as_state_dict(ray.get(self._published[0]))

    def fetch(self, num_groups: int, trainer_version: int) -> tuple[list[Group], int]:
        if self.mode == "sync":
            self._generate_lockstep(num_groups)
        take = self.buffer.take.remote(num_groups, trainer_version)
        while True:
            # A worker loop only ends early by failing: restart it, or raise what ended it, instead of waiting forever.
            runs = {w.run: w for w in self.workers if w.run is not None}
            ready, _ = ray.wait([take, *runs], num_returns=1)
            if take in ready:
                return groups_of(self._from_buffer(take))
            self._outcome(runs[ready[0]], ready[0])

    def fetch_ready(self, num_groups: int, trainer_version: int) -> tuple[list[Group], int] | None:
        """The groups fetch would return next if they have all arrived, else None, without waiting (nothing taken).
        Sync mode generates them now instead (the same ones: a ticket is seeded by its grant index, and the
        weights stay those of the cycle start)."""
        if self.mode == "sync":
            return self.fetch(num_groups, trainer_version)
        self._check_workers()  # fetch notices a dead worker while it waits; this takes without waiting
        return groups_of(self._from_buffer(self.buffer.take_ready.remote(num_groups, trainer_version)))

    def discard(self, count: int) -> None:
        """The trainer took count groups it does not train on (algorithm.filter_groups; ReplayBufferCore.discard)."""
        self._from_buffer(self.buffer.discard.remote(count))

    def _check_workers(self) -> None:
        """Restart every worker whose run() loop has ended by dying (or raise what ended it), without waiting."""
        runs = {w.run: w for w in self.workers if w.run is not None}
        if runs:
            ended, _ = ray.wait(list(runs), num_returns=len(runs), timeout=0)
            for ref in ended:
                self._outcome(runs[ref], ref)

    def _generate_lockstep(self, num_groups: int) -> None:
        """Have the workers generate the trigger's groups (the buffer holds none at a trigger's start in sync mode)."""
        while (buffered := int(self.stats()["replay/size"])) < num_groups:
            shares = np.array_split(np.arange(num_groups - buffered), len(self.workers))
            calls = {w.actor.step.remote(len(s)): w for w, s in zip(self.workers, shares) if len(s)}
            made = [self._outcome(worker, ref) for ref, worker in calls.items()]  # None: died and restarted
            if all(m == 0 for m in made):
                raise RolloutFailedError("the rollout workers stopped before the trigger's groups were generated")

    def _outcome(self, worker: _Worker, ref) -> Any:
        """ray.get(ref), a call or the run() loop of worker: its value; None if the worker died and was restarted
        (its tickets granted again); RolloutFailedError if it raised or its loop ended."""
        try:
            value = ray.get(ref)
        except RayTaskError as err:  # first: a worker whose call to a dead buffer failed is both kinds
            self._check_buffer()
            cause = err.cause if getattr(err, "cause", None) is not None else err
            raise RolloutFailedError(f"rollout worker {worker.index} raised {type(cause).__name__}: "
                                     f"{one_line(cause)}") from None  # fmt: skip
        except process_gone_errors() as err:  # the process is gone, however Ray says so
            self._restart(worker, death_in_words(err))
            return None
        if ref is worker.run:
            self._check_buffer()
            raise RolloutFailedError(f"rollout worker {worker.index} stopped before the trainer finished")
        return value

    def _restart(self, worker: _Worker, how: str) -> None:
        """worker's process died (how: in words): a new incarnation takes its place and its outstanding tickets are
        granted again."""
        self._check_buffer()
        limit = self.cfg.rollout.max_restarts
        if worker.restarts >= limit:
            raise RolloutFailedError(f"rollout worker {worker.index} {how} and its restarts are used up "
                                     f"({worker.restarts} of rollout.max_restarts={limit})")  # fmt: skip
        ray.kill(worker.actor, no_restart=True)
        regranted = self._from_buffer(self.buffer.release.remote(worker.holder))
        self.workers[worker.index] = self._spawn(worker.index, worker.restarts + 1)
        self.worker_restarts += 1
        log.warning(f"rollout worker {worker.index} {how}; restarted it ({worker.restarts + 1} of "
                    f"rollout.max_restarts={limit}); its {regranted} outstanding groups are generated anew")  # fmt: skip

    def _check_buffer(self) -> None:
        """RolloutFailedError if the replay buffer is dead or does not answer."""
        try:
            self._from_buffer(self.buffer.stats.remote(), timeout=BUFFER_TIMEOUT_S)
        except GetTimeoutError:
            raise RolloutFailedError(f"the replay buffer did not answer within {BUFFER_TIMEOUT_S:g} s") from None

    def _from_buffer(self, ref, timeout: float | None = None) -> Any:
        """ray.get of a replay-buffer call; RolloutFailedError if the buffer died."""
        try:
            return ray.get(ref, timeout=timeout)
        except process_gone_errors() as err:
            raise RolloutFailedError(f"the replay buffer {death_in_words(err)}") from None

    def stats(self) -> dict[str, float]:
        return {**self._from_buffer(self.buffer.stats.remote()), "rollout/worker_restarts": float(self.worker_restarts)}

    def close(self) -> None:
        """Kill the workers and the buffer and free the rollout's GPUs; never raises (any of them may be dead
        already)."""
        for actor in [*(w.actor for w in self.workers), self.buffer]:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001  an actor that is gone already, or a Ray that is shutting down
                pass
        try:
            remove_pool(self._groups)
        except Exception:  # noqa: BLE001  a Ray that is shutting down
            pass


def make_rollout(cfg, source: PromptSource, model_config, start: RolloutStart | None = None, early: bool = False):
    """The rollout source cfg asks for (cfg.use_ray, trainer.mode); source is the trainer's PromptSource,
    model_config the policy's HF config, start where it picks up (a fresh run's start by default); early: made
    before the actor's rank was built (local workers may then be forked)."""
    start = start or RolloutStart()
    if cfg.use_ray:
        return RayRollout(cfg, source, model_config, start)
    if cfg.trainer.mode == "separate_async":
        return LocalRollout(cfg, source, model_config, start, fork=early)
    return InProcessRollout(cfg, source, model_config, start)
