"""Rollout workers and the replay buffer as Ray actors (cfg.use_ray).

separate_async: each worker loops on its own (RolloutWorkerActor.run), the trainer only takes from the buffer.
sync: the trainer asks the workers for exactly the groups of each trigger (RolloutWorkerActor.step), then takes them.
The buffer is a threaded actor (buffer_server.ReplayBufferActor: a waiting acquire or take holds one of its threads).

A worker whose process dies, however Ray says so (killed, killed for memory, its node lost), is restarted as the
supervision base says (dppo.trainer.rollout.supervised); a worker whose call raised ends the rollout with its error,
and the replay buffer's death ends it too ("the replay buffer died").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch
from ray.exceptions import GetTimeoutError, RayTaskError

from dppo._text import one_line
from dppo.batch import Group
from dppo.trainer.state import RolloutStart
from dppo.data.source import PromptSource
from dppo.models import as_state_dict
from dppo.trainer.actor_deaths import death_in_words, process_gone_errors
from dppo.trainer.placement import bundle_options, place_pool, pool_nodes, pools, remove_pool
from dppo.trainer.rollout.common import RolloutFailedError, RolloutSettings, buffer_core
from dppo.trainer.rollout.settings import worker_settings
from dppo.trainer.rollout.supervised import SupervisedRollout, WorkerEnd, WorkerRecord
from dppo.workers.rollout.buffer_server import ReplayBufferActor, Taken
from dppo.workers.rollout.ray_worker import RolloutWorkerActor
from dppo.workers.sync_check import WeightFingerprint, WeightSyncMismatchError
from dppo.workers.weight_fingerprint import fingerprint_for, print_dtype

BUFFER_TIMEOUT_S = 30.0  # how long a liveness check waits for the replay buffer to answer


@dataclass
class RayWorker(WorkerRecord):
    """One incarnation of a rollout worker as a Ray actor."""

    actor: Any = None
    run: Any = None  # the ObjectRef of its run() loop (separate_async, once started)


class RayRollout(SupervisedRollout[RayWorker]):
    """Rollout workers and the replay buffer as Ray actors (see the module docstring)."""

    def __init__(self, cfg, source: PromptSource, model_config, start: RolloutStart):
        """cfg: the root config, read here: the workers get their RolloutWorkerSettings (worker_settings), the
        placement plans the rollout's pool from the trainer and rollout sections, the rest reads
        RolloutSettings.of(cfg)."""
        super().__init__(RolloutSettings.of(cfg), start)
        self.mode = self.settings.mode
        # GPU workers: one bundle each in the rollout's own placement groups (a restarted worker takes its
        # predecessor's); CPU workers (no pool): spread over the nodes, reserving nothing.
        self._pool = pools(cfg.trainer, cfg.rollout)[1]
        self._groups = (
            place_pool(self._pool, pool_nodes(cfg.trainer, cfg.rollout).rollout_nodes) if self._pool is not None else []
        )
        threads = ReplayBufferActor.threads(self.settings.rollout.num_workers)
        self.buffer = buffer_core(
            self.settings, start, ray.remote(num_cpus=0, max_concurrency=threads)(ReplayBufferActor).remote
        )
        self._worker_cls = ray.remote(num_cpus=0)(RolloutWorkerActor)
        # The PromptSource object itself goes to the workers (cloudpickle carries lambdas and closures): a worker
        # process has only the built-in tasks registered, so looking task.name up there would miss a
        # register_task one; text data arrives tokenized, with the tokenizer and the reward function.
        self._worker_args = (worker_settings(cfg, source, model_config), ray.put(source), model_config)
        self._running = False
        self._print_dtype = print_dtype(cfg.rollout, cfg.model.dtype)  # None: rollout.verify_sync=false
        self.workers = [self._spawn(i, self.new_holder(), 0) for i in range(self.settings.rollout.num_workers)]

    def _spawn(self, index: int, holder: int, restarts: int) -> RayWorker:
        settings, source_ref, model_config = self._worker_args
        options = (
            {"scheduling_strategy": "SPREAD"} if self._pool is None else bundle_options(self._pool, self._groups, index)
        )
        actor = self._worker_cls.options(**options).remote(
            settings, source_ref, model_config, index, self.buffer, holder
        )
        worker = RayWorker(index, holder, restarts, actor)
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
        or a state dict, put here once. The buffer hands the reference to each worker at its next boundary.
        published_weights() gives them back only once the buffer has them: where it dies in this call, they stay the
        last publish's (a checkpoint written after that failure saves them as the cycle's pi_old)."""
        if isinstance(weights, list):  # rank 0 put them there, and fingerprinted them last (rollout.verify_sync)
            fingerprint = weights[-1] if isinstance(weights[-1], WeightFingerprint) else None
            refs = [w for w in weights if not isinstance(w, WeightFingerprint)]
        else:  # one put here
            refs, fingerprint = [ray.put(weights)], fingerprint_for(weights, self._print_dtype)
        self._buffer_call("publish", refs, version, fingerprint)
        self._published = refs

    def published_weights(self) -> dict[str, torch.Tensor]:
        """The weights of the last publish, read back from the object store (their owner, the actor's rank 0 or this
        process, keeps them there after a worker or the buffer died)."""
        return as_state_dict(ray.get(self._published[0]))

    def fetch(self, num_groups: int, trainer_version: int) -> tuple[list[Group], int]:
        if self.mode == "sync":
            self._generate_lockstep(num_groups)
        return super().fetch(num_groups, trainer_version)

    def fetch_ready(self, num_groups: int, trainer_version: int) -> tuple[list[Group], int] | None:
        """Sync mode generates the groups now (the same ones: a ticket is seeded by its grant index, and the weights
        stay those of the cycle start)."""
        if self.mode == "sync":
            return self.fetch(num_groups, trainer_version)
        return super().fetch_ready(num_groups, trainer_version)

    def describe(self) -> str:
        """e.g. "rollout: Ray actors, 2 worker(s) on CPUs spread over the cluster's nodes, the replay buffer one more"
        (the nodes are Ray's to choose: the actors may still be starting)."""
        workers = (
            self._pool.describe()
            if self._pool is not None
            else f"{len(self.workers)} worker(s) on CPUs spread over the cluster's nodes"
        )
        return f"rollout: Ray actors, {workers}, the replay buffer one more"

    def _generate_lockstep(self, num_groups: int) -> None:
        """Have the workers generate the trigger's groups (the buffer holds none at a trigger's start in sync mode)."""
        while (buffered := int(self.stats()["replay/size"])) < num_groups:
            shares = np.array_split(np.arange(num_groups - buffered), len(self.workers))
            calls = {w.actor.step.remote(len(s)): w for w, s in zip(self.workers, shares) if len(s)}
            made = [self._step_result(worker, ref) for ref, worker in calls.items()]  # None: died and restarted
            if all(m == 0 for m in made):
                raise RolloutFailedError("the rollout workers stopped before the trigger's groups were generated")

    def _step_result(self, worker: RayWorker, ref) -> int | None:
        """Groups worker's step call made; None if the worker died and was restarted (its tickets granted again);
        RolloutFailedError if it raised."""
        value, end = self._result(ref)
        if end is not None:
            self._settle(worker, end)
        return value

    @staticmethod
    def _result(ref) -> tuple[Any, WorkerEnd | None]:
        """ray.get(ref) of a worker's call: (its value, None), or (None, how the worker ended)."""
        try:
            return ray.get(ref), None
        except RayTaskError as err:  # first: a worker whose call to a dead buffer failed is both kinds
            cause = err.cause if getattr(err, "cause", None) is not None else err
            if isinstance(cause, WeightSyncMismatchError):
                return None, WorkerEnd("mismatch", one_line(cause))
            return None, WorkerEnd("raised", f"{type(cause).__name__}: {one_line(cause)}")
        except process_gone_errors() as err:  # the process is gone, however Ray says so
            return None, WorkerEnd("died", death_in_words(err))

    def _ended(self, worker: RayWorker) -> WorkerEnd | None:
        """A run() loop ends only by failing: a worker that died, raised, or stopped before the trainer finished."""
        if worker.run is None or not ray.wait([worker.run], timeout=0)[0]:
            return None
        return self._result(worker.run)[1] or WorkerEnd("stopped")

    def _retire(self, worker: RayWorker) -> None:
        ray.kill(worker.actor, no_restart=True)

    def _taking(self, num_groups: int, trainer_version: int) -> Callable[[], Taken | None]:
        take = self.buffer.take.remote(num_groups, trainer_version)

        def wait() -> Taken | None:
            """Until the take returns or a worker's run() loop ends (restart it, or raise what ended it, instead of
            waiting forever)."""
            runs = [w.run for w in self.workers if w.run is not None]
            ready, _ = ray.wait([take, *runs], num_returns=1)
            return self._from_buffer(take) if take in ready else None

        return wait

    def _buffer_call(self, name: str, *args) -> Any:
        return self._from_buffer(getattr(self.buffer, name).remote(*args))

    def _check_buffer(self) -> None:
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
