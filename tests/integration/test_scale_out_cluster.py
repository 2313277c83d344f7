"""`dppo train` with two FSDP2 ranks on a Ray cluster of two nodes, as a user runs it: the ranks land on different
nodes (two raylets on this machine, ray.cluster_utils.Cluster, though either node has room for both) and train
in separate-async mode; a rank SIGKILLed mid-run ends the run within 60 s with one line naming the rank and its
node, the checkpoints intact; and training resumes from them (here at world size 1: DCP reshards)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dppo.checkpoint import store as ckpt
from dppo.config import load_config
from dppo.trainer.ppo import PPOTrainer

from tiny_run import THRESHOLD, tiny_run  # tests/tiny_run.py (tests/conftest.py puts tests/ on sys.path)

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def overrides(output_dir: Path, total_steps: int, *extra: str) -> list[str]:
    return tiny_run(
        output_dir,
        total_steps,
        "trainer.nnodes=2",
        "trainer.n_gpus_per_node=1",
        "trainer.train_batch_size=6",
        "trainer.checkpoint_every=1",
        "rollout.n=3",
        "rollout.groups_per_batch=3",
        "actor.micro_batch_size=4",
        *extra,
    )


def read_records(path: Path) -> list[dict]:
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


@pytest.fixture
def two_nodes():
    """A Ray cluster of two nodes with 2 CPUs each (the job joins it with ray.address)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


def test_two_nodes_train_async_and_a_killed_rank_ends_the_run_in_one_line_then_it_resumes(two_nodes, tmp_path):
    out = tmp_path / "run"
    metrics = out / "metrics.jsonl"
    log, err = tmp_path / "train.out", tmp_path / "train.err"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    args = overrides(out, 1000, f"ray.address={two_nodes.address}")
    with open(log, "wb") as stdout, open(err, "wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dppo", "train", *args],
            cwd=REPO,
            env=env,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and proc.poll() is None and len(read_records(metrics)) < 2:
            time.sleep(0.2)
        assert proc.poll() is None, log.read_text()[-3000:] + err.read_text()[-3000:]
        records = read_records(metrics)
        assert len(records) >= 2, "the run made no progress"
        ranks = re.search(
            r"actor: 2 rank\(s\), FSDP2: rank 0 on node \S+ \(id (\w+), pid \d+\), "
            r"rank 1 on node (\S+) \(id (\w+), pid (\d+)\)",
            log.read_text(),
        )
        assert ranks, log.read_text()
        assert ranks.group(1) != ranks.group(3), "the two ranks share a node"
        assert {ranks.group(1), ranks.group(3)} == {node.node_id[:8] for node in two_nodes.list_all_nodes()}
        node, pid = ranks.group(2), int(ranks.group(4))
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        returncode = proc.wait(timeout=60)
        took_s = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    records = read_records(metrics)
    for r in records:  # separate-async on two nodes: versions advance, staleness within the limit, training
        assert r["version"] == r["step"] and 0.0 <= r["staleness/mean"] <= r["staleness/max"] <= THRESHOLD
        assert 0.0 <= r["critic/score/mean"] <= 1.0 and r["actor/grad_norm"] > 0
    stderr_text = err.read_text()
    assert returncode == 1 and took_s < 60, (returncode, took_s, stderr_text[-3000:])
    errors = [line for line in stderr_text.splitlines() if line.startswith("dppo: error:")]
    assert len(errors) == 1 and stderr_text.strip().splitlines()[-1] == errors[0], stderr_text[-3000:]
    assert errors[0].startswith(f"dppo: error: actor rank 1 of 2 died (node {node}, node id {ranks.group(3)}")
    assert f"pid {pid}" in errors[0] and "Traceback" not in stderr_text, stderr_text[-3000:]

    # the checkpoints are intact: the newest verifies, and training continues from it, at world size 1
    checkpoints = ckpt.CheckpointDir(out / "checkpoints")
    latest = checkpoints.directory / checkpoints.recorded()[-1].name
    assert f"its last checkpoint {latest} is intact" in errors[0]
    step = checkpoints.trusted(latest)["step"]  # it verifies: every file as its manifest says
    assert step >= 1
    cfg = load_config(
        [*overrides(out, step + 1, "trainer.resume=true"), "trainer.nnodes=1", "ray.enabled=false", "trainer.mode=sync"]
    )
    resumed = PPOTrainer(cfg)
    assert resumed.resumed_from == latest and resumed.global_step == step
    result = resumed.fit()
    assert [r["step"] for r in read_records(metrics)] == list(range(1, step + 2))
    assert result.records[-1]["step"] == step + 1 and 0.0 <= result.evaluation["eval/reward"] <= 1.0
