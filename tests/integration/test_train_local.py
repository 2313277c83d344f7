"""`dppo train`'s default on one CPU machine: no Ray; the actor's rank in the trainer's process and the rollout
workers as local processes beside it (dppo.trainer.rollout.local_source). The run as a user starts it, a rollout
worker SIGKILLed mid-run (restarted, as a fresh interpreter, with a task registered in the trainer only), and a run
resumed from its checkpoint (its workers spawned, not forked)."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dppo.cli import main
from dppo.trainer.report import read_metrics

from processes import kill_the_local_worker_mid_run  # tests/processes.py (conftest.py puts tests/ on sys.path)
from tiny_run import THRESHOLD, tiny_run  # tests/tiny_run.py

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def overrides(output_dir: Path, total_steps: int, *extra: str) -> list[str]:
    return tiny_run(output_dir, total_steps, "ray.enabled=null", "trainer.checkpoint_every=2", *extra)


def test_the_default_run_trains_without_ray(tmp_path, capfd, monkeypatch):
    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    out = tmp_path / "out"
    assert main(["train", *overrides(out, 4)]) == 0
    text = capfd.readouterr().out
    assert re.search(rf"actor: 1 rank\(s\), plain module: rank 0 on node \S+ \(id -, pid {os.getpid()}\)", text), text
    assert re.search(r"rollout: 1 worker process\(es\) on this machine, no Ray \(pid \d+\)", text), text
    assert "memory estimate:" in text and "rollout worker" in text
    assert not ray.is_initialized()
    steps = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["staleness/max"] <= THRESHOLD and r["replay/dropped_total"] == 0 for r in steps)
    assert max(r["staleness/max"] for r in steps) == 1  # the rollout ran ahead of the trainer: asynchronous
    assert (out / "hf_model" / "config.json").exists()


# The trainer's process registers a task (a worker spawned afresh has only the built-in ones) and trains on it.
_REGISTERED = textwrap.dedent("""
    import sys
    from dppo.cli import main
    from dppo.tasks import digit_task, register_task
    register_task("shift", lambda length: digit_task("shift", length, lambda d: (d + 1) % 10))
    sys.exit(main(["train", *sys.argv[1:]]))
""")


def test_a_killed_rollout_worker_is_restarted_and_the_run_completes(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-c", _REGISTERED, *overrides(out, 8, "task.name=shift")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)},
    )
    err = kill_the_local_worker_mid_run(proc, out / "metrics.jsonl", after_steps=1, wait_s=120)
    assert proc.returncode == 0, err[-3000:]
    assert "rollout worker 0 was killed by SIGKILL; restarted it (1 of rollout.max_restarts=3)" in err, err[-3000:]
    steps = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert steps[-1]["rollout/worker_restarts"] == 1.0
    assert all(r["replay/dropped_total"] == 0 for r in steps)


def test_a_resumed_run_spawns_its_workers_and_goes_on(tmp_path, capfd, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    out = tmp_path / "out"
    assert main(["train", *overrides(out, 2)]) == 0
    assert main(["train", *overrides(out, 4, "trainer.resume=true")]) == 0
    text = capfd.readouterr().out
    assert "resumed from" in text and "(global step 2)" in text
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]
