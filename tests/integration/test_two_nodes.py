"""trainer.nnodes=2 on a Ray cluster of two nodes (two raylets on this machine, ray.cluster_utils.Cluster): the two
ranks land on different nodes, though either node has room for both, meet over gloo, and train."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from dppo.trainer.config import load_config
from dppo.trainer.ppo import PPOTrainer

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_two_nodes_one_rank_each_train_two_steps(tmp_path):
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    try:
        ray.init(address=cluster.address, include_dashboard=False, logging_level="WARNING",
                 runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}})  # fmt: skip
        node_ids = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert len(node_ids) == 2
        overrides = {
            "trainer.nnodes": 2, "trainer.n_gpus_per_node": 1, "trainer.total_steps": 2, "trainer.mode": "sync",
            "trainer.parameter_sync_step": 2, "trainer.train_batch_size": 4, "trainer.output_dir": tmp_path / "run",
            "trainer.eval_prompts": 8, "trainer.checkpoint_every": 0, "trainer.progress_bar": False, "rollout.n": 3,
            "rollout.groups_per_batch": 2, "task.length": 3, "model.hidden_size": 32, "model.num_hidden_layers": 1,
            "model.num_attention_heads": 2, "model.intermediate_size": 64,
        }  # fmt: skip
        trainer = PPOTrainer(load_config([f"{k}={v}" for k, v in overrides.items()]))
        placed = [n["node_id"] for n in trainer.actor.nodes]
        assert set(placed) == node_ids, placed  # one rank on each node
        assert trainer.actor.nodes[0]["node_id"] == ray.get_runtime_context().get_node_id()  # rank 0: the driver's
        result = trainer.fit()
        assert [r["step"] for r in result.records] == [1, 2]
        assert all(r["actor/grad_norm"] > 0 and r["staleness/max"] == 0.0 for r in result.records)
        assert 0.0 <= result.evaluation["eval/reward"] <= 1.0
    finally:
        ray.shutdown()
        cluster.shutdown()
