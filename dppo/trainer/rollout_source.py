"""Where the trainer's groups come from: Ray rollout workers (async or lockstep) or an in-process generator.

Both sources run the same worker step (ticket from the replay buffer -> load newer weights -> generate ->
put) and the same replay-buffer logic; they differ only in who runs the step and when.
"""

from __future__ import annotations

import os

import numpy as np

from dppo.rollout import Group
from dppo.tasks import Task
from dppo.workers.replay_buffer import ReplayBufferActor, ReplayBufferCore
from dppo.workers.rollout_worker import RolloutGenerator, RolloutWorkerActor


class InProcessRollout:
    """trainer.mode=sync without Ray: generate each trigger's groups in this process, then take them."""

    def __init__(self, cfg, task: Task, model_config, held_out: np.ndarray | None, start_version: int = 0,
                 seed_offset: int = 0):  # fmt: skip
        self.buffer = ReplayBufferCore(cfg.replay.max_off_policy_threshold, cfg.replay.max_off_policy_strategy,
                                       cfg.trainer.train_batch_size, start_version)  # fmt: skip
        self.worker = RolloutGenerator(cfg, task, model_config, 0, held_out, seed_offset)

    def start(self) -> None:
        pass

    def publish(self, state_dict, version: int) -> None:
        self.buffer.publish(state_dict, version)

    def fetch(self, num_groups: int, trainer_version: int) -> tuple[list[Group], int]:
        """(groups, groups dropped since the last fetch)."""
        made = 0
        while made < num_groups:
            ticket = self.buffer.acquire(self.worker.version, num_groups - made)
            if ticket is None:
                raise RuntimeError(f"replay buffer refused to grant groups in sync mode ({self.buffer.stats()})")
            if ticket.weights is not None:
                self.worker.load_weights(ticket.weights, ticket.version)
            self.buffer.put(self.worker.generate(ticket.num_groups), ticket.first)
            made += ticket.num_groups
        result = self.buffer.take(num_groups, trainer_version)
        assert result is not None, "groups generated for this trigger must be takeable"
        return result

    def stats(self) -> dict[str, float]:
        return self.buffer.stats()

    def close(self) -> None:
        self.buffer.close()


class RayConnectError(ConnectionError):
    """The Ray cluster named by ray.address or RAY_ADDRESS could not be reached or refused this process."""


def init_ray(cfg) -> bool:
    """Connect to ray.address, else RAY_ADDRESS, else start a local cluster (quietly); nothing if this process
    is already connected. True if this call connected (then the caller owns the connection and shuts it down).
    RayConnectError, naming the address, if a given cluster cannot be joined."""
    import ray

    if ray.is_initialized():
        return False
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS") or None
    kwargs = dict(address=address, include_dashboard=False, log_to_driver=True, logging_level="WARNING",
                  configure_logging=True)  # fmt: skip
    if address is None and cfg.ray.num_cpus is not None:
        kwargs["num_cpus"] = cfg.ray.num_cpus
    # Workers must import dppo from the same tree as the driver, also when it is not installed.
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pythonpath = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    kwargs["runtime_env"] = {"env_vars": {"PYTHONPATH": pythonpath, "HF_HUB_OFFLINE": "1",
                                          "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(cfg.rollout.num_threads)}}  # fmt: skip
    try:
        ray.init(**kwargs)
    except ConnectionError as err:  # ray raises ConnectionError (or a subclass) once its retries are spent
        if address is None:
            raise
        raise RayConnectError(
            f"could not join the Ray cluster at {address!r} (ray.address or RAY_ADDRESS): {err}. If the cluster "
            "uses Ray's token authentication (on by default in recent Ray versions: 2.59 for local clusters, 2.61 for all), run "
            "with RAY_AUTH_MODE=token and the cluster's token in ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or "
            "RAY_AUTH_TOKEN"
        ) from err
    return True


class RayRollout:
    """Rollout workers and the replay buffer as Ray actors.

    separate_async: each worker loops on its own, the trainer only takes from the buffer.
    sync: the trainer asks the workers for exactly the groups of each trigger, then takes them.
    """

    def __init__(self, cfg, task: Task, model_config, held_out: np.ndarray | None, start_version: int = 0,
                 seed_offset: int = 0):  # fmt: skip
        import ray

        init_ray(cfg)
        self.mode = cfg.trainer.mode
        self.buffer = ray.remote(num_cpus=0)(ReplayBufferActor).remote(
            cfg.replay.max_off_policy_threshold, cfg.replay.max_off_policy_strategy,
            cfg.trainer.train_batch_size, start_version,
        )  # fmt: skip
        worker_cls = ray.remote(num_cpus=0)(RolloutWorkerActor)
        # The Task object itself goes to the workers (cloudpickle carries lambdas and closures): a worker process
        # has only the built-in tasks registered, so looking task.name up there would miss a register_task one.
        task_ref = ray.put(task)
        self.workers = [
            worker_cls.options(scheduling_strategy="SPREAD").remote(cfg, task_ref, model_config, i, held_out,
                                                                    seed_offset, self.buffer)  # fmt: skip
            for i in range(cfg.rollout.num_workers)
        ]
        self._runs: list = []

    def start(self) -> None:
        if self.mode == "separate_async":
            self._runs = [w.run.remote() for w in self.workers]

    def publish(self, state_dict, version: int) -> None:
        import ray

        # One put; the buffer hands the reference to each worker at its next generation boundary.
        ray.get(self.buffer.publish.remote([ray.put(state_dict)], version))

    def fetch(self, num_groups: int, trainer_version: int) -> tuple[list[Group], int]:
        import ray

        if self.mode == "sync":
            self._generate_lockstep(num_groups)
        take = self.buffer.take.remote(num_groups, trainer_version)
        if self._runs:
            # A worker loop only ends early by failing: surface its error instead of waiting forever.
            ready, _ = ray.wait([take, *self._runs], num_returns=1)
            if take not in ready:
                ray.get(ready)  # raises the worker's exception
                raise RuntimeError("a rollout worker stopped before the trainer finished")
        return ray.get(take)

    def _generate_lockstep(self, num_groups: int) -> None:
        import ray

        remaining = num_groups
        while remaining > 0:
            shares = np.array_split(np.arange(remaining), len(self.workers))
            made = ray.get([w.step.remote(len(s)) for w, s in zip(self.workers, shares) if len(s)])
            if sum(made) == 0:
                raise RuntimeError("rollout workers stopped before the trigger's groups were generated")
            remaining -= sum(made)

    def stats(self) -> dict[str, float]:
        import ray

        return ray.get(self.buffer.stats.remote())

    def close(self) -> None:
        import ray

        try:
            ray.get(self.buffer.close.remote())
            if self._runs:
                ray.get(self._runs, timeout=60)
        finally:
            for actor in [*self.workers, self.buffer]:
                ray.kill(actor)


def make_rollout(cfg, task: Task, model_config, held_out: np.ndarray | None, start_version: int = 0,
                 seed_offset: int = 0):  # fmt: skip
    """The rollout source cfg asks for (ray.enabled, trainer.mode); task is the trainer's Task, model_config the
    policy's HF config."""
    cls = RayRollout if cfg.ray.enabled else InProcessRollout
    return cls(cfg, task, model_config, held_out, start_version, seed_offset)
