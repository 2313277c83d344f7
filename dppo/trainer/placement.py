"""Where the actor's ranks and the rollout's GPU workers go on a Ray cluster: two resource pools, apart.

- The actor's pool: trainer.nnodes x trainer.n_gpus_per_node bundles, one per rank: a GPU and a CPU when the
  ranks go on GPUs, a CPU on the CPU.
- The rollout's pool: rollout.nnodes x rollout.n_gpus_per_node bundles of a GPU and a CPU, one per rollout
  worker (verl's keys for a standalone rollout pool). rollout.n_gpus_per_node=0 (the default) is no pool: the
  rollout workers are CPU processes (rollout.num_threads each) that Ray spreads over the nodes, taking no
  reserved resources.

Each pool is one STRICT_PACK placement group per node, pinned to its node (a label selector on Ray's node id), so
a GPU reserved for a rollout worker is never a rank's. choose_nodes, a pure function of the cluster's nodes,
chooses the nodes of both pools at once (PoolNodes): a cluster that cannot hold both is refused (PlacementError,
one line with the counts) before any placement group is made. The choice is a function of the nodes' total
resources, so the actor's worker group, the rollout and the preflight check make the same one independently.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

PLACEMENT_TIMEOUT_S = 120.0  # how long a pool's placement groups may take to be placed


class PlacementError(RuntimeError):
    """The Ray cluster cannot host the actor's ranks and the rollout's workers (nodes, GPUs or CPUs missing)."""


@dataclass(frozen=True)
class Pool:
    """nnodes x per_node bundles of the same resources, one per rank or rollout worker."""

    name: str  # "actor" or "rollout": whose bundles, in messages
    section: str  # the config section of its keys: "trainer" or "rollout"
    nnodes: int
    per_node: int
    bundle: dict[str, float] = field(hash=False)  # one rank's or worker's resources, e.g. {"GPU": 1.0, "CPU": 1.0}

    @property
    def size(self) -> int:
        """Bundles in all (ranks or rollout workers)."""
        return self.nnodes * self.per_node

    @property
    def node_need(self) -> dict[str, float]:
        """What the pool's placement group takes on each of its nodes."""
        return {k: v * self.per_node for k, v in self.bundle.items()}

    def keys(self) -> str:
        return f"{self.section}.nnodes={self.nnodes} x {self.section}.n_gpus_per_node={self.per_node}"

    def describe(self) -> str:
        """e.g. "the actor's 2 ranks (trainer.nnodes=1 x trainer.n_gpus_per_node=2, each {'GPU': 1, 'CPU': 1})"."""
        what = ("rank" if self.name == "actor" else "worker") + ("s" if self.size != 1 else "")
        return f"the {self.name}'s {self.size} {what} ({self.keys()}, each {_shown(self.bundle)})"


def actor_pool(nnodes: int, per_node: int, use_gpu: bool) -> Pool:
    """The actor's ranks: a GPU and a CPU each on GPUs, a CPU each on the CPU."""
    return Pool("actor", "trainer", nnodes, per_node, {"GPU": 1.0, "CPU": 1.0} if use_gpu else {"CPU": 1.0})


def rollout_pool(nnodes: int, n_gpus_per_node: int, gpus_per_worker: int = 1) -> Pool | None:
    """The rollout workers' GPUs, or None (n_gpus_per_node=0: CPU workers, nothing reserved). Each worker's bundle
    holds gpus_per_worker GPUs and a CPU; a node's GPUs are split into whole workers (the config checks that)."""
    if n_gpus_per_node == 0:
        return None
    assert n_gpus_per_node % gpus_per_worker == 0, (n_gpus_per_node, gpus_per_worker)
    bundle = {"GPU": float(gpus_per_worker), "CPU": 1.0}
    return Pool("rollout", "rollout", nnodes, n_gpus_per_node // gpus_per_worker, bundle)


@dataclass(frozen=True)
class PoolNodes:
    """Node ids of each pool, one per placement group (the actor's rank 0 on actor_nodes[0])."""

    actor_nodes: list[str]
    rollout_nodes: list[str]  # [] without a rollout pool


def _fits(have: dict[str, float], need: dict[str, float]) -> bool:
    return all(have.get(k, 0.0) >= v for k, v in need.items())


def _sum(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in {*a, *b}}


def _kind(have: dict[str, float], need_a: dict[str, float], need_r: dict[str, float]) -> str | None:
    """What a node with resources `have` can host: "both" pools at once, "either" one, only the "actor"'s or the
    "rollout"'s group, or None."""
    if _fits(have, _sum(need_a, need_r)):
        return "both"
    a, r = _fits(have, need_a), _fits(have, need_r)
    return "either" if a and r else "actor" if a else "rollout" if r else None


def choose_nodes(actor: Pool, rollout: Pool | None, nodes: list[dict[str, Any]], here: str | None = None) -> PoolNodes:
    """The nodes of both pools, from Ray's node table (ray.nodes(): "NodeID", "Alive", "Resources").

    A pool's placement groups go on distinct nodes; a node may host one of each pool if it holds both at once.
    Nodes that can host only one pool go to it first; nodes that can host both at once serve both; the rest serve
    one pool each, the actor first. That finds a placement whenever one exists. Within each kind, the driver's
    node (here) comes first, then the others by node id. PlacementError with the counts if none exists."""
    alive = sorted((n for n in nodes if n.get("Alive", True)), key=lambda n: (n["NodeID"] != here, n["NodeID"]))
    need_a = actor.node_need
    need_r, count_r = (rollout.node_need, rollout.nnodes) if rollout is not None else ({}, 0)
    kinds: dict[str, list[str]] = {"actor": [], "rollout": [], "both": [], "either": []}
    for node in alive:
        kind = _kind(node["Resources"], need_a, need_r)
        if kind is not None:
            kinds[kind].append(node["NodeID"])
    actor_nodes, rollout_nodes = kinds["actor"][: actor.nnodes], kinds["rollout"][:count_r]
    shared = min(len(kinds["both"]), actor.nnodes - len(actor_nodes), count_r - len(rollout_nodes))
    actor_nodes += kinds["both"][:shared]
    rollout_nodes += kinds["both"][:shared]
    single = kinds["both"][shared:] + kinds["either"]  # each of these hosts one pool
    more_a = actor.nnodes - len(actor_nodes)
    actor_nodes += single[:more_a]
    rollout_nodes += single[more_a:][: count_r - len(rollout_nodes)]
    if len(actor_nodes) < actor.nnodes or len(rollout_nodes) < count_r:
        raise PlacementError(_refusal(actor, rollout, nodes, len(actor_nodes), len(rollout_nodes)))
    order = {n["NodeID"]: i for i, n in enumerate(alive)}
    return PoolNodes(sorted(actor_nodes, key=order.get), sorted(rollout_nodes, key=order.get))


def _refusal(actor: Pool, rollout: Pool | None, nodes: list[dict], actor_placed: int, rollout_placed: int) -> str:
    """One line: what the pools need, per node and in all, and what the cluster's alive nodes have."""
    pools = [actor] + ([rollout] if rollout is not None else [])
    total: dict[str, float] = {}
    for pool in pools:
        total = _sum(total, {k: v * pool.nnodes for k, v in pool.node_need.items()})
    have = [{k: n["Resources"].get(k, 0.0) for k in total} for n in nodes if n.get("Alive", True)]
    cluster = {k: sum(h[k] for h in have) for k in total}
    wanted = " and ".join(p.describe() for p in pools)
    placed = f"{actor_placed} of {actor.nnodes} actor node(s)" + (
        f", {rollout_placed} of {rollout.nnodes} rollout node(s)" if rollout is not None else ""
    )
    return (
        f"the Ray cluster cannot hold {wanted}: they need {_shown(total)} in all, "
        f"{' + '.join(_shown(p.node_need) for p in pools)} per node, but its {len(have)} alive node(s) have "
        f"{_shown(cluster)} in all ({', '.join(_shown(h) for h in have)}); placed {placed}"
    )


def _shown(resources: dict[str, float]) -> str:
    """{'GPU': 1, 'CPU': 1}: whole numbers without '.0', GPU first."""
    items = sorted(resources.items(), key=lambda kv: (kv[0] != "GPU", kv[0] != "CPU", kv[0]))
    return "{" + ", ".join(f"'{k}': {int(v) if float(v).is_integer() else v}" for k, v in items) + "}"


# ---- on the Ray cluster ------------------------------------------------------------------------------


def use_gpus(trainer) -> bool:
    """Whether the actor's ranks go on GPUs (trainer: the config's trainer section): trainer.device=cuda, or auto on a
    cluster that has GPUs."""
    device = trainer.device
    return device == "cuda" or (device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)


def pools(trainer, rollout) -> tuple[Pool, Pool | None]:
    """The actor's pool and the rollout's (None: CPU rollout workers) on the cluster this process is connected to, from
    the config's trainer and rollout sections."""
    t, r = trainer, rollout
    return actor_pool(t.nnodes, t.n_gpus_per_node, use_gpus(t)), rollout_pool(r.nnodes, r.n_gpus_per_node)


def pool_nodes(trainer, rollout) -> PoolNodes:
    """choose_nodes for cfg's pools on the cluster this process is connected to (PlacementError if they do not fit).
    The same nodes every time while the cluster's nodes stay the same: the actor's worker group and the rollout
    each compute it when they place their pool, and the preflight check before either."""
    return choose_nodes(*pools(trainer, rollout), ray.nodes(), ray.get_runtime_context().get_node_id())


def place_pool(pool: Pool, node_ids: list[str]) -> list:
    """One ready STRICT_PACK placement group per node of node_ids, pool.per_node bundles each, pinned to its node.
    PlacementError (the groups removed again) if they are not placed within PLACEMENT_TIMEOUT_S."""
    groups = [
        placement_group(
            [pool.bundle] * pool.per_node,
            strategy="STRICT_PACK",
            bundle_label_selector=[{"ray.io/node-id": node}] * pool.per_node,
        )
        for node in node_ids
    ]
    ready, _ = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=PLACEMENT_TIMEOUT_S)
    if len(ready) < len(groups):
        for g in groups:
            remove_placement_group(g)
        raise PlacementError(
            f"{pool.describe()} were not placed within {PLACEMENT_TIMEOUT_S:.0f} s; the cluster "
            f"has {_shown({k: ray.available_resources().get(k, 0.0) for k in pool.bundle})} free"
        )
    return groups


def bundle_options(pool: Pool, groups: list, index: int) -> dict[str, Any]:
    """Ray actor options of rank or worker `index` (0-based, node by node): its bundle's CPUs and GPUs, in
    placement group index // per_node, bundle index % per_node. Ray then gives the actor the bundle's GPUs
    (ray.get_gpu_ids(), and CUDA_VISIBLE_DEVICES naming only them)."""
    group, bundle = divmod(index, pool.per_node)
    strategy = PlacementGroupSchedulingStrategy(groups[group], placement_group_bundle_index=bundle)
    return {
        "num_cpus": pool.bundle.get("CPU", 0.0),
        "num_gpus": pool.bundle.get("GPU", 0.0),
        "scheduling_strategy": strategy,
    }


def remove_pool(groups: list) -> None:
    """Free a pool's placement groups (the actors in them are killed by Ray)."""
    for group in groups:
        remove_placement_group(group)
