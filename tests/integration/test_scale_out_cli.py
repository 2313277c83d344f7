"""`dppo train` with two FSDP2 ranks as a user runs it: separate-async training at world size 2; a rank SIGKILLed
mid-run ends the run within 60 s with one line naming the rank and its node, the checkpoints intact; and the
run resumes from them (at world size 1)."""

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

from dppo.trainer import checkpoint_dir

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
THRESHOLD = 1


def overrides(output_dir: Path, total_steps: int, *extra: str) -> list[str]:
    return [
        f"trainer.output_dir={output_dir}",
        f"trainer.total_steps={total_steps}",
        "trainer.n_gpus_per_node=2",
        "trainer.parameter_sync_step=2",
        "trainer.train_batch_size=6",
        "trainer.checkpoint_every=1",
        "trainer.eval_prompts=16",
        "trainer.progress_bar=false",
        "rollout.n=3",
        "rollout.groups_per_batch=3",
        f"replay.max_off_policy_threshold={THRESHOLD}",
        "task.length=3",
        "model.hidden_size=32",
        "model.num_hidden_layers=1",
        "model.num_attention_heads=2",
        "model.intermediate_size=64",
        "actor.micro_batch_size=4",
        "ray.num_cpus=2",
        *extra,
    ]


ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "RAY_ADDRESS": ""}


def session_pids(sid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,sid="], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid, s in zip(out[::2], out[1::2]) if int(s) == sid]


def kill_leftovers(sid: int) -> None:
    """SIGKILL whatever of the run's session (its local Ray cluster) outlived it, by pid."""
    deadline = time.monotonic() + 15
    while (left := session_pids(sid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def read_records(path: Path) -> list[dict]:
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def test_a_killed_rank_ends_the_run_in_one_line_and_the_run_resumes(tmp_path):
    out = tmp_path / "run"
    metrics = out / "metrics.jsonl"
    log, err = tmp_path / "first.out", tmp_path / "first.err"
    with open(log, "wb") as stdout, open(err, "wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "dppo.train", *overrides(out, 1000)], cwd=REPO, env=ENV,
                                stdout=stdout, stderr=stderr, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and proc.poll() is None and not checkpoint_dir.list_checkpoints(out / "checkpoints")[1:]:
            time.sleep(0.2)
        assert proc.poll() is None, log.read_text()[-3000:] + err.read_text()[-3000:]
        records = read_records(metrics)
        assert len(records) >= 2, "the run made no progress"
        for r in records:  # separate-async at world size 2: versions advance, staleness within the limit
            assert r["version"] == r["step"] and 0.0 <= r["staleness/mean"] <= r["staleness/max"] <= THRESHOLD
            assert 0.0 <= r["critic/score/mean"] <= 1.0 and r["actor/grad_norm"] > 0
        ranks = re.search(r"actor: 2 rank\(s\), FSDP2: rank 0 on node (\S+) \(pid (\d+)\), "
                          r"rank 1 on node (\S+) \(pid (\d+)\)", log.read_text())  # fmt: skip
        assert ranks, log.read_text()
        node, pid = ranks.group(3), int(ranks.group(4))
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        returncode = proc.wait(timeout=60)
        took_s = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        kill_leftovers(proc.pid)
    stderr_text = err.read_text()
    assert returncode == 1 and took_s < 60, (returncode, took_s, stderr_text[-3000:])
    errors = [line for line in stderr_text.splitlines() if line.startswith("dppo: error:")]
    assert len(errors) == 1 and stderr_text.strip().splitlines()[-1] == errors[0], stderr_text[-3000:]
    assert errors[0].startswith(f"dppo: error: actor rank 1 of 2 died (node {node}") and f"pid {pid}" in errors[0]
    assert "Traceback" not in stderr_text, stderr_text[-3000:]

    # the checkpoints are intact: the newest verifies, and the run continues from it (here at world size 1: DCP
    # reshards the two ranks' shards; tests/integration/test_scale_out.py resumes at world size 2)
    latest = checkpoint_dir.latest_checkpoint(out / "checkpoints")
    assert latest is not None and f"its last checkpoint {latest} is intact" in errors[0]
    step = checkpoint_dir.verify(latest)["step"]
    assert step >= 2
    resumed = subprocess.run([sys.executable, "-m", "dppo.train", *overrides(out, step + 1, "trainer.resume=true", "trainer.n_gpus_per_node=1")],
                             cwd=REPO, env=ENV, capture_output=True, text=True, timeout=240, start_new_session=True)  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from {latest} (global step {step})" in resumed.stdout
    assert [r["step"] for r in read_records(metrics)] == list(range(1, step + 2))
