"""`dppo train` on a local Ray cluster as a user runs it: a few async steps, SIGKILL, resume."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
THRESHOLD = 1


def overrides(output_dir: Path, total_steps: int, *extra: str) -> list[str]:
    return [
        f"trainer.output_dir={output_dir}",
        f"trainer.total_steps={total_steps}",
        "trainer.parameter_sync_step=2",
        "trainer.train_batch_size=8",
        "trainer.checkpoint_every=2",
        "trainer.eval_prompts=16",
        "trainer.progress_bar=false",
        "rollout.num_workers=1",
        "rollout.n=4",
        "rollout.groups_per_batch=4",
        f"replay.max_off_policy_threshold={THRESHOLD}",
        "task.length=3",
        "model.hidden_size=32",
        "model.num_hidden_layers=1",
        "model.num_attention_heads=2",
        "model.intermediate_size=64",
        "ray.num_cpus=2",
        *extra,
    ]


def start(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "RAY_ADDRESS": ""}
    with open(log, "wb") as f:
        # A new session: the run and every process it starts (the local Ray cluster) can be found by its id.
        return subprocess.Popen([sys.executable, "-m", "dppo.train", *args], cwd=REPO, env=env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def session_pids(sid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,sid="], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid, s in zip(out[::2], out[1::2]) if int(s) == sid]


def kill_session(sid: int) -> None:
    """SIGKILL the run's process group, then anything of its session that outlives it (by pid)."""
    os.killpg(sid, signal.SIGKILL)
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
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line torn by the kill
    return records


def test_async_run_sigkill_and_resume(tmp_path):
    out = tmp_path / "run"
    metrics = out / "metrics.jsonl"
    # Two workers: the wait strategy takes groups in grant order, so even then none is dropped (asserted below).
    proc = start(overrides(out, 1000, "rollout.num_workers=2"), tmp_path / "first.log")
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and len(read_records(metrics)) >= 5:
                break
            time.sleep(0.2)
        assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert len(read_records(metrics)) >= 5, "the run made no progress in 90 s"
    finally:
        kill_session(proc.pid)
        proc.wait()
    before = read_records(metrics)
    checkpoints = sorted((out / "checkpoints").glob("step_*.pt"))
    last_ckpt = int(checkpoints[-1].stem.split("_")[1])
    assert last_ckpt % 2 == 0 and last_ckpt >= 4
    assert last_ckpt <= before[-1]["step"]
    total = last_ckpt + 3

    args = overrides(out, total, "trainer.resume=true", "rollout.num_workers=2")
    resumed = subprocess.run([sys.executable, "-m", "dppo.train", *args],
                             cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "RAY_ADDRESS": ""},
                             capture_output=True, text=True, timeout=150, start_new_session=True)  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from {checkpoints[-1]} (global step {last_ckpt})" in resumed.stdout
    assert f"metrics: {metrics}" in resumed.stdout and "plot:" in resumed.stdout
    assert (out / "training_curves.png").stat().st_size > 10_000

    records = read_records(metrics)
    assert [r["step"] for r in records] == list(range(1, total + 1))  # every step once, none lost twice
    # Steps up to the checkpoint are the killed run's own lines; only later ones were redone.
    assert records[:last_ckpt] == before[:last_ckpt]
    required = ["critic/score/mean", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "staleness/mean",
                "timing_s/step", "timing_s/gen_wait", "timing_s/old_log_prob", "timing_s/snapshot",
                "timing_s/update_actor", "rollout_corr/weight_mean", "rollout_corr/kl_k1"]  # fmt: skip
    for r in records:
        for key in required:
            assert key in r, (r["step"], key)
        # Staleness accounting: versions advance once per step and no consumed group is older than allowed.
        assert r["version"] == r["step"]
        assert 0.0 <= r["staleness/mean"] <= r["staleness/max"] <= THRESHOLD
        assert r["replay/dropped_total"] == 0.0  # the wait strategy never needs to drop, with any number of workers
        assert 0.0 <= r["critic/score/mean"] <= 1.0
    summary = json.loads((out / "summary.json").read_text())
    assert 0.0 <= summary["evaluation"]["eval/accuracy"] <= 1.0


def test_sync_mode_on_ray_is_lockstep(tmp_path):
    """trainer.mode=sync runs the same workers in lockstep: every group is generated by the current version."""
    out = tmp_path / "sync"
    run = subprocess.run([sys.executable, "-m", "dppo.train", *overrides(out, 3, "trainer.mode=sync")],
                         cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "RAY_ADDRESS": ""},
                         capture_output=True, text=True, timeout=150, start_new_session=True)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = read_records(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["staleness/mean"] == 0.0 and r["staleness/max"] == 0.0
        assert r["replay/size"] == 0.0 and r["replay/in_flight"] == 0.0  # nothing generated ahead


def test_a_failing_rollout_worker_fails_the_run(tmp_path):
    """An exception in a worker (here: the task's reward function) ends the run with that error, not a hang."""
    (tmp_path / "broken_task_mod.py").write_text(
        "from dppo.tasks import Task, digit_task\n"
        "def make(length):\n"
        "    good = digit_task('broken', length, lambda d: d)\n"
        "    def reward_fn(prompts, responses, mask):\n"
        "        raise ValueError('reward service unavailable')\n"
        "    return Task('broken', good.prompt_fn, reward_fn, good.answer_length, good.vocab_size)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}", "RAY_ADDRESS": ""}
    run = subprocess.run([sys.executable, "-m", "dppo.train", *overrides(tmp_path / "out", 2, "task.name=broken_task_mod:make")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120, start_new_session=True)  # fmt: skip
    assert run.returncode != 0
    assert "reward service unavailable" in run.stderr


USER_TASK_SCRIPT = """\
import sys

import ray

from dppo.tasks import digit_task, register_task
from dppo.train import run
from dppo.trainer.config import load_config

# Registered in the driver only, built from a lambda and closures: the workers get the Task object itself.
register_task("shift", lambda length: digit_task("shift", length, lambda d: (d + 1) % 10))
# The caller's own Ray cluster: run() must use it and leave it up.
ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
run(load_config(sys.argv[1:]))
print("ray up after run:", ray.is_initialized())
"""


def test_a_task_registered_in_the_driver_runs_on_ray_workers(tmp_path):
    """register_task works in the default Ray mode, and run() leaves a Ray cluster it did not start up."""
    script = tmp_path / "train_user_task.py"
    script.write_text(USER_TASK_SCRIPT)
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, str(script), *overrides(out, 2, "task.name=shift")],
                         cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "RAY_ADDRESS": ""},
                         capture_output=True, text=True, timeout=150, start_new_session=True)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert [r["step"] for r in read_records(out / "metrics.jsonl")] == [1, 2]
    assert "ray up after run: True" in run.stdout
