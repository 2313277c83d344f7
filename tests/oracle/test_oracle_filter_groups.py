"""algorithm.filter_groups keeps exactly the groups verl 0.9.1's own DAPO filter keeps (its v1 ReplayBuffer's
_dapo_filtered_keys), on random groups, for the reward and for an extra output of the reward function.

verl's replay buffer module imports transfer_queue (not installed: verl's dependencies are not) for its storage; a stub
module stands in for it, and its kv_batch_get hands verl the groups' values in the form its trajectories hold them:
token-level rm_scores (the reward at the last token), or extra_fields.reward_extra_info."""

from __future__ import annotations

import importlib.util
import sys
import types
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

from dppo.batch import Group
from dppo.trainer.filter_groups import keeps

pytestmark = pytest.mark.oracle


@pytest.fixture(scope="module")
def verl_replay_buffer():
    import verl

    stub = types.ModuleType("transfer_queue")
    stub.KVBatchMeta = object
    saved = sys.modules.get("transfer_queue")
    sys.modules["transfer_queue"] = stub
    try:
        path = Path(verl.__file__).parent / "trainer" / "ppo" / "v1" / "replay_buffer.py"
        spec = importlib.util.spec_from_file_location("verl_v1_replay_buffer", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        if saved is None:
            sys.modules.pop("transfer_queue", None)
        else:
            sys.modules["transfer_queue"] = saved


def random_groups(seed: int, count: int = 200) -> list[tuple[np.ndarray, np.ndarray]]:
    """(rewards, acc) per group, fp32, 1 to 6 responses: a third of the groups one value repeated, a third two
    values a float32 step apart, the rest any of a few values (so that ties are common); acc 0 or 1."""
    rng = np.random.default_rng(seed)
    close = np.array([0.3, np.nextafter(np.float32(0.3), np.float32(1))], dtype=np.float32)
    values = np.array([0.0, 0.25, 1.0, *close], dtype=np.float32)
    out = []
    for _ in range(count):
        n, kind = int(rng.integers(1, 7)), rng.integers(0, 3)
        rewards = np.full(n, rng.choice(values)) if kind == 0 else rng.choice(close if kind == 1 else values, size=n)
        acc = np.full(n, float(rng.integers(0, 2))) if rng.random() < 0.4 else rng.integers(0, 2, size=n)
        out.append((rewards.astype(np.float32), acc.astype(np.float32)))
    return out


def dppo_group(rewards: np.ndarray, acc: np.ndarray, index: int) -> Group:
    n = len(rewards)
    return Group(
        torch.zeros(2, dtype=torch.long),
        torch.zeros(n, 3, dtype=torch.long),
        torch.ones(n, 3, dtype=torch.bool),
        torch.zeros(n, 3),
        torch.from_numpy(rewards),
        0,
        index,
        {"acc": torch.from_numpy(acc)},
    )


def verl_filtered(module, groups, metric: str) -> set[str]:
    """The uids verl's _dapo_filtered_keys drops, with every group finished."""
    uids = [f"g{i}" for i in range(len(groups))]
    trajectories = {
        f"{uid}_{j}": (float(rewards[j]), float(acc[j]))
        for uid, (rewards, acc) in zip(uids, groups)
        for j in range(len(rewards))
    }

    def kv_batch_get(keys, partition_id, select_fields):
        if select_fields == ["rm_scores"]:  # token-level: the reward at the last of 3 response tokens
            return {"rm_scores": [torch.tensor([0.0, 0.0, trajectories[k][0]], dtype=torch.float32) for k in keys]}
        return {"extra_fields": [{"reward_extra_info": {"acc": trajectories[k][1]}} for k in keys]}

    module.tq.kv_batch_get = kv_batch_get
    buffer = module.ReplayBuffer.__new__(module.ReplayBuffer)
    buffer.filter_groups_metric = metric
    buffer.finished_keys = {"train": set(uids)}
    buffer.partitions = {"train": {key: {} for key in trajectories}}
    buffer._dapo_classification_cache = defaultdict(dict)
    filtered, _ = buffer._dapo_filtered_keys("train")
    return filtered


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("metric", ["reward", "acc"])
def test_the_groups_kept_are_verls(verl_replay_buffer, seed, metric):
    groups = random_groups(seed)
    dropped_by_verl = verl_filtered(verl_replay_buffer, groups, metric)
    dropped_by_dppo = {f"g{i}" for i, (r, a) in enumerate(groups) if not keeps(dppo_group(r, a, i), metric)}
    assert dropped_by_dppo == dropped_by_verl
    assert 0.2 * len(groups) < len(dropped_by_verl) < 0.8 * len(groups)  # both kinds are there to tell apart
