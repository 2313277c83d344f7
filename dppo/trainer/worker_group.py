"""The actor as a worker group: trainer.nnodes x trainer.n_gpus_per_node ActorRanks behind one object.

    actor = make_worker_group(cfg, pi_old_choice, vocab_size)
    metrics = actor.update_actor(trigger, batch, advantages, version)   # DP: the batch split over the ranks
    actor.save_model_to_cpu(0)                                  # ALL: every rank snapshots its own shards

actor.<method>(...) calls dppo.workers.actor.rank.ActorRank.<method> on every rank at once and applies the
method's dispatch mode (dppo.workers.dispatch). Two ways to hold the ranks, one rank class:

- RayWorkerGroup (ray.enabled=true): each rank is a Ray actor in the actor's resource pool (dppo.trainer.placement):
  one placement group per node, one bundle per rank (a GPU and a CPU on CUDA, a CPU on the CPU), STRICT_PACK so a
  node's ranks sit together, each group pinned to its own node (a label selector on Ray's node id); the nodes are
  chosen together with the rollout's GPU pool, the driver's first where it fits. The ranks meet at rank 0's node
  address on a free port (NCCL or gloo).
- LocalWorkerGroup (ray.enabled=false): the one rank in this process (tests and debugging).

Failures: if a rank's process dies, the call raises RankDiedError naming the rank and its node, once the other
ranks (which would wait for it in a collective until trainer.collective_timeout_s) have been killed; any
other error of a rank is raised after the same clean-up.
"""

from __future__ import annotations

from typing import Any

import ray

from dppo._errors import RankDiedError
from dppo.config import DppoConfig
from dppo.config.pi_old import PiOldChoice
from dppo.trainer.actor_deaths import death_in_words, process_gone_errors
from dppo.trainer.placement import bundle_options, place_pool, pool_nodes, pools, remove_pool
from dppo.workers.actor.rank import ActorRank, uses_fsdp
from dppo.workers.actor.settings import ActorSettings
from dppo.workers.dispatch import (
    ALL,
    DP,
    DP_GATHER,
    RANK0,
    collect,
    dispatch_mode,
    gather_rows,
    split_args,
    split_each,
)
from dppo.workers.rollout.engine_config import publishes_deltas


class WorkerGroup:
    """world_size ActorRanks; group.<registered method>(*args) runs it on all of them (see the module docstring)."""

    world_size: int = 1

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        mode = dispatch_mode(ActorRank, name)

        def call(*args: Any) -> Any:
            return self._dispatch(name, mode, args)

        call.__name__, call.__doc__ = name, getattr(ActorRank, name).__doc__
        return call

    def _dispatch(self, name: str, mode: str, args: tuple) -> Any:
        if mode == DP_GATHER:
            return gather_rows(self._run(name, split_each(args, self.world_size)), [b.num_sequences for b in args[0]])
        per_rank = split_args(args, self.world_size) if mode == DP else [list(args)] * self.world_size
        return collect(mode, self._run(name, per_rank))

    def _run(self, name: str, per_rank: list[list[Any]]) -> list[Any]:
        raise NotImplementedError

    def rollout_weights(self, anchor: bool = False, adapter: dict | None = None):
        """The whole model's weights as the rollout takes them (see ActorRank.rollout_weights)."""
        raise NotImplementedError

    def describe(self) -> str:
        """One line: how many ranks, sharded or not, and where each runs."""
        where = ", ".join(
            f"rank {n['rank']} on node {n['node_ip']} (id {(n['node_id'] or '-')[:8]}, pid {n['pid']})"
            for n in self.nodes
        )
        return f"actor: {self.world_size} rank(s), {'FSDP2' if self.sharded else 'plain module'}: {where}"

    def close(self) -> None:
        raise NotImplementedError


class LocalWorkerGroup(WorkerGroup):
    """The single rank of ray.enabled=false, in this process (local_rank: the ActorRank itself)."""

    def __init__(self, rank: ActorRank) -> None:
        self.world_size = 1
        self.local_rank = rank
        self.sharded = rank.sharded
        self.nodes = [rank.node_info()]

    def _run(self, name: str, per_rank: list[list[Any]]) -> list[Any]:
        return [getattr(self.local_rank, name)(*per_rank[0])]

    def rollout_weights(self, anchor: bool = False, adapter: dict | None = None):
        return self._dispatch("rollout_weights", RANK0, (False, anchor, adapter))

    def close(self) -> None:
        self.local_rank.close()


class RayWorkerGroup(WorkerGroup):
    """The ranks as Ray actors (see the module docstring)."""

    def __init__(self, cfg: DppoConfig, pi_old_choice: PiOldChoice, vocab_size: int) -> None:
        pool = pools(cfg.trainer, cfg.rollout)[0]
        self.world_size = pool.size
        self.sharded = uses_fsdp(cfg.actor.fsdp, self.world_size)
        self._groups = place_pool(pool, pool_nodes(cfg.trainer, cfg.rollout).actor_nodes)
        self._dead = False
        rank_cls = ray.remote(ActorRank)
        # no runtime_env of their own: the ranks can start in the job's idle worker processes (torch's threads
        # are set in init_model)
        self._actors = [
            rank_cls.options(**bundle_options(pool, self._groups, rank), max_restarts=0).remote(
                actor_settings(cfg),
                pi_old_choice,
                rank,
                self.world_size,
                vocab_size,
                True,
                publishes_deltas(cfg.rollout),
            )
            for rank in range(self.world_size)
        ]
        self.nodes = [{"rank": rank, "node_id": None, "node_ip": "?", "pid": None} for rank in range(self.world_size)]
        self.nodes = self._dispatch("node_info", ALL, ())
        master = ray.get(self._actors[0].master_address.remote())
        self._dispatch("init_model", ALL, master)

    def _run(self, name: str, per_rank: list[list[Any]]) -> list[Any]:
        if self._dead:
            raise RuntimeError(f"the actor's worker group was shut down after a failure; cannot call {name}")
        return self._wait([getattr(actor, name).remote(*args) for actor, args in zip(self._actors, per_rank)])

    def _wait(self, futures: list) -> list[Any]:
        """Every rank's result; on the first failure the whole group is torn down and the error raised."""
        pending = list(futures)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(ready[0])
            except process_gone_errors() as err:  # killed, killed for memory, its node lost
                rank = futures.index(ready[0])
                self._abort()
                raise RankDiedError(self._died(rank, err)) from None
            except BaseException:
                self._abort()
                raise
        return ray.get(futures)

    def _died(self, rank: int, err: BaseException) -> str:
        node = self.nodes[rank]
        reason = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
        node_id = (node["node_id"] or "?")[:12]
        where = f"node {node['node_ip']}, node id {node_id}, pid {node['pid']}"
        how = death_in_words(err)
        if how != "died":  # memory, or the node: the words say it all, Ray's message is pages long
            return f"actor rank {rank} of {self.world_size} {how} ({where})"
        return f"actor rank {rank} of {self.world_size} died ({where}): {reason}"

    def _abort(self) -> None:
        """Kill every rank (the living ones may be waiting in a collective for a dead one) and free the nodes."""
        self._dead = True
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        remove_pool(self._groups)

    def rollout_weights(self, anchor: bool = False, adapter: dict | None = None):
        return self._dispatch("rollout_weights", RANK0, (True, anchor, adapter))

    def close(self) -> None:
        if self._dead:
            return
        try:
            self._dispatch("close", ALL, ())
        finally:
            if not self._dead:
                self._abort()


def actor_settings(cfg: DppoConfig) -> ActorSettings:
    """What each actor rank of cfg reads (the ranks receive this, never the config)."""
    t = cfg.trainer
    return ActorSettings(
        actor=cfg.actor,
        algorithm=cfg.algorithm,
        model=cfg.model,
        rollout=cfg.rollout,
        seed=t.seed,
        device=t.device,
        num_threads=t.num_threads,
        collective_timeout_s=t.collective_timeout_s,
        total_steps=t.total_steps,
        parameter_sync_step=t.parameter_sync_step,
    )


def make_worker_group(cfg: DppoConfig, pi_old_choice: PiOldChoice, vocab_size: int) -> WorkerGroup:
    """The actor's ranks for cfg: Ray actors with ray.enabled, else the one rank in this process. pi_old_choice: the
    run's (dppo.config.pi_old), handed to every rank as it is, as is its actor_settings(cfg)."""
    if cfg.use_ray:
        return RayWorkerGroup(cfg, pi_old_choice, vocab_size)
    rank = ActorRank(actor_settings(cfg), pi_old_choice, 0, 1, vocab_size)
    rank.init_model(*rank.master_address())
    return LocalWorkerGroup(rank)
