"""The actor's ranks and the rollout's GPU workers on a real Ray cluster that declares GPUs without CUDA (two
raylets on this machine, 4 and 2 GPUs as resources): probe actors placed with the options the real ranks and
workers get (dppo.trainer.placement) land on the planned nodes, in disjoint bundles, and Ray gives each the
GPU ids of its own bundle."""

from __future__ import annotations

import os

import pytest

from dppo.trainer.placement import Plan, actor_pool, bundle_options, place_pool, plan_nodes, remove_pool, rollout_pool

pytestmark = pytest.mark.integration


def probe_class():
    """An actor class that says where Ray put it and which GPUs it was given (made here, so that Ray ships it by
    value: tests/ is no package its workers could import)."""

    class Probe:
        def where(self) -> tuple[str, list[int], str | None]:
            import os

            import ray

            gpu_ids = [int(g) for g in ray.get_gpu_ids()]
            return ray.get_runtime_context().get_node_id(), gpu_ids, os.environ.get("CUDA_VISIBLE_DEVICES")

    return Probe


@pytest.fixture(scope="module")
def cluster():
    """Head node (the driver's) with 4 GPUs and 4 CPUs, a second node with 2 GPUs and 4 CPUs; the test connects."""
    import ray
    from ray.cluster_utils import Cluster

    saved = os.environ.pop("RAY_ADDRESS", None)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 4})
    cluster.add_node(num_cpus=4, num_gpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False, logging_level="WARNING")
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        if saved is not None:
            os.environ["RAY_ADDRESS"] = saved


def place_and_probe(actor, rollout):
    """Plan from the live node table, place both pools, start one probe per rank and per worker; returns
    (plan, {pool name: [(node id, gpu ids, CUDA_VISIBLE_DEVICES) per rank or worker]}, {pool name: groups})."""
    import ray

    plan = plan_nodes(actor, rollout, ray.nodes(), ray.get_runtime_context().get_node_id())
    groups = {"actor": place_pool(actor, plan.actor_nodes), "rollout": place_pool(rollout, plan.rollout_nodes)}
    probe_cls = ray.remote(probe_class())
    seen = {}
    try:
        for pool in (actor, rollout):
            probes = [probe_cls.options(**bundle_options(pool, groups[pool.name], i)).remote() for i in range(pool.size)]
            seen[pool.name] = ray.get([p.where.remote() for p in probes], timeout=60)
            for p in probes:
                ray.kill(p)
    except BaseException:
        for g in groups.values():
            remove_pool(g)
        raise
    return plan, seen, groups


def check_groups(groups: list, pool, node_ids: list[str]) -> None:
    """Each placement group of the pool: per_node bundles of pool.bundle, all on its planned node."""
    from ray.util.placement_group import placement_group_table

    for group, node_id in zip(groups, node_ids, strict=True):
        table = placement_group_table(group)
        assert table["strategy"] == "STRICT_PACK"
        assert list(table["bundles"].values()) == [pool.bundle] * pool.per_node
        assert set(table["bundles_to_node_id"].values()) == {node_id}


def check_disjoint(seen: dict) -> None:
    """No GPU of a node given twice; every rank and worker sees exactly its own GPU as CUDA_VISIBLE_DEVICES."""
    given = [(node, gpu) for entries in seen.values() for node, gpus, _ in entries for gpu in gpus]
    assert len(given) == len(set(given)), seen
    for entries in seen.values():
        for _, gpus, visible in entries:
            assert len(gpus) == 1 and visible == str(gpus[0]), entries


def test_one_node_holds_both_pools_in_disjoint_gpus(cluster):
    import ray

    head = ray.get_runtime_context().get_node_id()
    actor, rollout = actor_pool(1, 2, use_gpu=True), rollout_pool(1, 2)
    plan, seen, groups = place_and_probe(actor, rollout)
    try:
        assert plan == Plan([head], [head])
        check_groups(groups["actor"], actor, plan.actor_nodes)
        check_groups(groups["rollout"], rollout, plan.rollout_nodes)
        assert {node for entries in seen.values() for node, _, _ in entries} == {head}
        check_disjoint(seen)
        assert sorted(g for entries in seen.values() for _, gpus, _ in entries for g in gpus) == [0, 1, 2, 3]
    finally:
        for g in groups.values():
            remove_pool(g)


def test_pools_that_cannot_share_a_node_go_to_different_nodes(cluster):
    import ray

    head = ray.get_runtime_context().get_node_id()
    other = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head)
    actor, rollout = actor_pool(1, 4, use_gpu=True), rollout_pool(1, 2)  # 6 GPUs: the head holds 4
    plan, seen, groups = place_and_probe(actor, rollout)
    try:
        assert plan == Plan([head], [other])
        check_groups(groups["actor"], actor, [head])
        check_groups(groups["rollout"], rollout, [other])
        assert [node for node, _, _ in seen["actor"]] == [head] * 4
        assert [node for node, _, _ in seen["rollout"]] == [other] * 2
        check_disjoint(seen)
    finally:
        for g in groups.values():
            remove_pool(g)


def test_two_nodes_each_hold_a_rank_and_a_worker(cluster):
    import ray

    head = ray.get_runtime_context().get_node_id()
    other = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head)
    actor, rollout = actor_pool(2, 1, use_gpu=True), rollout_pool(2, 1)
    plan, seen, groups = place_and_probe(actor, rollout)
    try:
        assert plan == Plan([head, other], [head, other])
        assert [node for node, _, _ in seen["actor"]] == [head, other]  # rank 0 on the driver's node
        assert [node for node, _, _ in seen["rollout"]] == [head, other]
        check_disjoint(seen)
    finally:
        for g in groups.values():
            remove_pool(g)
