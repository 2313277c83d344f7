"""choose_nodes: the nodes of the actor's and the rollout's pools, chosen from Ray's node table without Ray."""

import itertools

import pytest

from dppo.trainer.placement import PlacementError, PoolNodes, actor_pool, choose_nodes, rollout_pool


def node(node_id: str, gpus: float = 0, cpus: float = 8, alive: bool = True) -> dict:
    """A row of ray.nodes() as choose_nodes reads it."""
    resources = {"CPU": float(cpus), **({"GPU": float(gpus)} if gpus else {})}
    return {"NodeID": node_id, "Alive": alive, "Resources": resources}


def used(chosen: PoolNodes, actor, rollout, nodes) -> dict[str, dict[str, float]]:
    """What the chosen nodes hold, node by node."""
    load = {n["NodeID"]: {} for n in nodes}
    for pool, ids in ((actor, chosen.actor_nodes), (rollout, chosen.rollout_nodes)):
        for i in ids:
            for k, v in pool.node_need.items():
                load[i][k] = load[i].get(k, 0.0) + v
    return load


def assert_valid(chosen: PoolNodes, actor, rollout, nodes) -> None:
    """Each pool on as many distinct alive nodes as it asks for, and no node holding more than it has."""
    assert len(set(chosen.actor_nodes)) == len(chosen.actor_nodes) == actor.nnodes
    assert len(set(chosen.rollout_nodes)) == len(chosen.rollout_nodes) == (rollout.nnodes if rollout else 0)
    have = {n["NodeID"]: n["Resources"] for n in nodes if n["Alive"]}
    for node_id, load in used(chosen, actor, rollout, nodes).items():
        if load:
            assert node_id in have, f"{node_id} is dead"
            assert all(have[node_id].get(k, 0) >= v for k, v in load.items()), (node_id, load, have[node_id])


def test_pools_bundles():
    assert actor_pool(1, 2, use_gpu=True).bundle == {"GPU": 1.0, "CPU": 1.0}
    assert actor_pool(1, 2, use_gpu=False).bundle == {"CPU": 1.0}
    assert rollout_pool(1, 0) is None  # CPU rollout workers reserve nothing
    pool = rollout_pool(2, 4)
    assert (pool.nnodes, pool.per_node, pool.size, pool.bundle) == (2, 4, 8, {"GPU": 1.0, "CPU": 1.0})
    assert pool.node_need == {"GPU": 4.0, "CPU": 4.0}
    wide = rollout_pool(1, 4, gpus_per_worker=2)  # e.g. a tensor-parallel engine of 2 GPUs per worker
    assert (wide.per_node, wide.bundle["GPU"]) == (2, 2.0)


def test_one_node_holds_both_pools():
    nodes = [node("a", gpus=4)]
    actor, rollout = actor_pool(1, 2, True), rollout_pool(1, 2)
    chosen = choose_nodes(actor, rollout, nodes, here="a")
    assert chosen == PoolNodes(["a"], ["a"])


def test_one_node_too_small_for_both_is_refused_with_the_counts():
    nodes = [node("a", gpus=4, cpus=16)]
    with pytest.raises(PlacementError) as err:
        choose_nodes(actor_pool(1, 4, True), rollout_pool(1, 1), nodes, here="a")
    message = str(err.value)
    assert "\n" not in message
    for fragment in (
        "the actor's 4 ranks (trainer.nnodes=1 x trainer.n_gpus_per_node=4",
        "the rollout's 1 worker (rollout.nnodes=1 x rollout.n_gpus_per_node=1",
        "need {'GPU': 5, 'CPU': 5} in all",
        "its 1 alive node(s) have {'GPU': 4, 'CPU': 16} in all",
        "placed 1 of 1 actor node(s), 0 of 1 rollout node(s)",
    ):
        assert fragment in message, message


def test_rollout_gpus_on_a_cluster_without_gpus_are_refused():
    with pytest.raises(PlacementError, match=r"need \{'GPU': 1, 'CPU': 2\} in all.*have \{'GPU': 0, 'CPU': 8\}"):
        choose_nodes(actor_pool(1, 1, False), rollout_pool(1, 1), [node("a", cpus=8)], here="a")


def test_without_a_rollout_pool_the_actor_takes_the_driver_node_first():
    nodes = [node("a", gpus=2), node("b", gpus=2), node("c", gpus=1)]
    assert choose_nodes(actor_pool(1, 2, True), None, nodes, here="b") == PoolNodes(["b"], [])
    assert choose_nodes(actor_pool(2, 2, True), None, nodes, here="b") == PoolNodes(["b", "a"], [])
    with pytest.raises(PlacementError, match=r"placed 2 of 3 actor node\(s\)$"):
        choose_nodes(actor_pool(3, 2, True), None, nodes, here="b")


def test_two_nodes_a_pool_each_when_neither_holds_both():
    nodes = [node("a", gpus=4), node("b", gpus=4)]
    chosen = choose_nodes(actor_pool(1, 4, True), rollout_pool(1, 4), nodes, here="a")
    assert chosen == PoolNodes(["a"], ["b"])


def test_dead_nodes_are_not_used():
    nodes = [node("a", gpus=4), node("b", gpus=4, alive=False), node("c", gpus=4)]
    assert choose_nodes(actor_pool(1, 4, True), rollout_pool(1, 4), nodes, here="a") == PoolNodes(["a"], ["c"])


def test_a_node_only_one_pool_fits_goes_to_that_pool():
    # The driver's node b (8 GPUs) is the only one the rollout's 8-GPU group fits; a greedy "actor on the driver's
    # node first" would take it and leave the rollout nowhere.
    nodes = [node("a", gpus=4), node("b", gpus=8)]
    chosen = choose_nodes(actor_pool(1, 4, True), rollout_pool(1, 8), nodes, here="b")
    assert chosen == PoolNodes(["a"], ["b"])


def test_a_node_that_holds_both_serves_both_before_single_nodes_are_spent():
    # a holds both 2-GPU groups at once; b and c hold one each. Two actor nodes and two rollout nodes fit only if
    # a serves both pools.
    nodes = [node("a", gpus=4), node("b", gpus=2), node("c", gpus=2)]
    actor, rollout = actor_pool(2, 2, True), rollout_pool(2, 2)
    chosen = choose_nodes(actor, rollout, nodes, here="b")
    assert_valid(chosen, actor, rollout, nodes)
    assert "a" in chosen.actor_nodes and "a" in chosen.rollout_nodes


def _brute_force_exists(actor, rollout, nodes) -> bool:
    """Whether any placement exists (every choice of distinct nodes per pool)."""
    alive = [n for n in nodes if n["Alive"]]
    ids = [n["NodeID"] for n in alive]
    for a in itertools.permutations(ids, actor.nnodes):
        for r in itertools.permutations(ids, rollout.nnodes):
            chosen = PoolNodes(list(a), list(r))
            load = used(chosen, actor, rollout, alive)
            if all(all(n["Resources"].get(k, 0) >= v for k, v in load[n["NodeID"]].items()) for n in alive):
                return True
    return False


@pytest.mark.parametrize("seed", range(60))
def test_a_placement_is_found_exactly_when_one_exists(seed):
    """Mixed clusters of 2-5 nodes against a brute-force search (about 2 in 3 of these seeds can be placed)."""
    import random

    rng = random.Random(seed)
    nodes = [
        node(f"n{i}", gpus=rng.choice([0, 2, 4, 4, 8]), cpus=rng.choice([4, 16, 16]), alive=rng.random() > 0.1)
        for i in range(rng.randint(2, 5))
    ]
    actor = actor_pool(rng.randint(1, 2), rng.choice([1, 2, 4]), use_gpu=rng.random() > 0.2)
    rollout = rollout_pool(rng.randint(1, 2), rng.choice([1, 2, 4]))
    exists = _brute_force_exists(actor, rollout, nodes)
    if exists:
        chosen = choose_nodes(actor, rollout, nodes, here=nodes[0]["NodeID"])
        assert_valid(chosen, actor, rollout, nodes)
    else:
        with pytest.raises(PlacementError):
            choose_nodes(actor, rollout, nodes, here=nodes[0]["NodeID"])
