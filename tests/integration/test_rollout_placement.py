"""The actor's ranks and the rollout's GPU workers on a real Ray cluster that declares GPUs without CUDA (two
raylets on this machine, 4 and 2 GPUs as resources): probe actors placed with the options the real ranks and
workers get (dppo.trainer.placement) land on the chosen nodes, in disjoint bundles, and Ray gives each the
GPU ids of its own bundle."""

from __future__ import annotations

import os
import re

import pytest
from tiny_run import tiny_run  # tests/tiny_run.py (tests/conftest.py puts tests/ on sys.path)

from dppo.trainer.placement import (
    PoolNodes,
    actor_pool,
    bundle_options,
    place_pool,
    choose_nodes,
    remove_pool,
    rollout_pool,
)

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
    """Choose the nodes from the live node table, place both pools, start one probe per rank and per worker; returns
    (chosen, {pool name: [(node id, gpu ids, CUDA_VISIBLE_DEVICES) per rank or worker]}, {pool name: groups})."""
    import ray

    chosen = choose_nodes(actor, rollout, ray.nodes(), ray.get_runtime_context().get_node_id())
    groups = {"actor": place_pool(actor, chosen.actor_nodes), "rollout": place_pool(rollout, chosen.rollout_nodes)}
    probe_cls = ray.remote(probe_class())
    seen = {}
    try:
        for pool in (actor, rollout):
            probes = [
                probe_cls.options(**bundle_options(pool, groups[pool.name], i)).remote() for i in range(pool.size)
            ]
            seen[pool.name] = ray.get([p.where.remote() for p in probes], timeout=240)
            for p in probes:
                ray.kill(p)
    except BaseException:
        for g in groups.values():
            remove_pool(g)
        raise
    return chosen, seen, groups


def check_groups(groups: list, pool, node_ids: list[str]) -> None:
    """Each placement group of the pool: per_node bundles of pool.bundle, all on its chosen node."""
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
    chosen, seen, groups = place_and_probe(actor, rollout)
    try:
        assert chosen == PoolNodes([head], [head])
        check_groups(groups["actor"], actor, chosen.actor_nodes)
        check_groups(groups["rollout"], rollout, chosen.rollout_nodes)
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
    chosen, seen, groups = place_and_probe(actor, rollout)
    try:
        assert chosen == PoolNodes([head], [other])
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
    chosen, seen, groups = place_and_probe(actor, rollout)
    try:
        assert chosen == PoolNodes([head, other], [head, other])
        assert [node for node, _, _ in seen["actor"]] == [head, other]  # rank 0 on the driver's node
        assert [node for node, _, _ in seen["rollout"]] == [head, other]
        check_disjoint(seen)
    finally:
        for g in groups.values():
            remove_pool(g)


def run_overrides(tmp_path, cluster, *extra: str) -> list[str]:
    """A tiny run on the test's cluster, with extra keys."""
    return tiny_run(tmp_path / "run", 2, f"ray.address={cluster.address}", "trainer.mode=sync", *extra)


def test_the_real_rollout_workers_get_their_own_gpus(cluster, tmp_path):
    """RayRollout places its workers in the rollout's pool beside the actor's placed ranks: each worker is handed
    a GPU none of the ranks has. Without CUDA the worker then refuses to start, and its error names that GPU."""
    import ray

    from dppo.config import load_config
    from dppo.data import make_prompt_source
    from dppo.models import tiny_model_config
    from dppo.trainer.placement import pool_nodes, pools
    from dppo.trainer.state import RolloutStart
    from dppo.trainer.rollout import RayRollout

    cfg = load_config(
        run_overrides(
            tmp_path,
            cluster,
            "trainer.n_gpus_per_node=2",
            "rollout.n_gpus_per_node=2",
            "rollout.num_workers=2",
            "rollout.max_restarts=0",
        )
    )
    actor = pools(cfg.trainer, cfg.rollout)[0]
    assert actor.bundle == {"GPU": 1.0, "CPU": 1.0}  # trainer.device=auto on a cluster with GPUs
    actor_groups = place_pool(actor, pool_nodes(cfg.trainer, cfg.rollout).actor_nodes)  # what RayWorkerGroup places
    rollout = None
    try:
        probes = [
            ray.remote(probe_class()).options(**bundle_options(actor, actor_groups, i)).remote() for i in range(2)
        ]
        actor_gpus = {gpu for _, gpus, _ in ray.get([p.where.remote() for p in probes], timeout=240) for gpu in gpus}
        source = make_prompt_source(cfg)
        rollout = RayRollout(cfg, source, tiny_model_config(source.vocab_size, 32, 1, 2, 64), RolloutStart())
        worker_gpus = []
        for worker in rollout.workers:
            with pytest.raises(ray.exceptions.RayActorError) as err:
                ray.get(worker.actor.__ray_ready__.remote(), timeout=240)
            found = re.search(rf"rollout worker {worker.index} was given GPU\(s\) \['(\d+)'\] by Ray", str(err.value))
            assert found, str(err.value)[-2000:]
            worker_gpus.append(int(found.group(1)))
        assert len(set(worker_gpus)) == 2 and not set(worker_gpus) & actor_gpus, (worker_gpus, actor_gpus)
        assert sorted([*worker_gpus, *actor_gpus]) == [0, 1, 2, 3]  # all on the driver's node (it holds both)
    finally:
        if rollout is not None:
            rollout.close()
        remove_pool(actor_groups)


def test_dppo_train_refuses_pools_the_cluster_cannot_hold_before_anything_starts(
    cluster, tmp_path, capsys, monkeypatch
):
    """4 actor GPUs and 4 rollout GPUs on nodes of 4 and 2 GPUs: one line with the counts, exit code 2, before the
    trainer is built (which would already clear an earlier run's checkpoints in trainer.output_dir)."""
    import ray

    from dppo.cli import main
    from dppo.trainer import ppo

    monkeypatch.setattr(ppo, "PPOTrainer", lambda *a, **k: pytest.fail("the trainer was built"))

    args = run_overrides(
        tmp_path, cluster, "trainer.n_gpus_per_node=4", "rollout.n_gpus_per_node=4", "rollout.num_workers=4"
    )
    assert main(["train", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("dppo: error: the Ray cluster cannot hold the actor's 4 ranks"), lines
    assert "they need {'GPU': 8, 'CPU': 8} in all" in lines[-1] and "have {'GPU': 6, 'CPU': 8} in all" in lines[-1]
    assert "placed 1 of 1 actor node(s), 0 of 1 rollout node(s)" in lines[-1]
    assert ray.util.placement_group_table() == {} or all(
        g["state"] == "REMOVED" for g in ray.util.placement_group_table().values()
    )  # nothing was placed
