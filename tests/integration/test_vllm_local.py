"""`dppo train rollout.name=vllm` on one CPU machine without Ray (runs in .venv-vllm: make test-vllm): the vLLM
engines in local rollout processes, generating while the trainer trains; the demo task learns, and a worker
SIGKILLed mid-run is restarted as a fresh interpreter (which starts its own engine) and the run completes; and in
sync mode the engine inside the trainer's own process, checkpoints included."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")

from dppo.trainer.report import read_metrics  # noqa: E402

from integration.test_vllm_ray import VLLM_MODEL  # noqa: E402  (tests/ is on sys.path)
from processes import kill_the_local_worker_mid_run  # noqa: E402
from tiny_run import tiny_run  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[2]
STEPS = 24


def test_a_local_async_vllm_run_learns_and_survives_a_killed_worker(tmp_path):
    out = tmp_path / "out"
    args = tiny_run(
        out,
        STEPS,
        "ray.enabled=null",
        "trainer.checkpoint_every=0",
        "rollout.name=vllm",
        *VLLM_MODEL,
        "task.length=2",
        "trainer.eval_prompts=16",
        "rollout.groups_per_batch=8",
        "trainer.train_batch_size=16",
        "rollout.n=8",
        # the threshold below was set with a constant lr (the defaults' cosine lowers it over this short run)
        "actor.optim.lr_scheduler_type=constant",
        "actor.optim.lr_warmup_steps_ratio=0",
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "RAY_ADDRESS": ""}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dppo", "train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
        start_new_session=True,
    )
    err = kill_the_local_worker_mid_run(proc, out / "metrics.jsonl", after_steps=2, wait_s=180)
    assert proc.returncode == 0, err[-3000:]
    assert "rollout worker 0 was killed by SIGKILL; restarted it (1 of rollout.max_restarts=3)" in err, err[-3000:]
    assert "Chat template warmup failed" not in err  # the vLLM start-up warnings the engine's own choices cause
    steps = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert steps[-1]["rollout/worker_restarts"] == 1.0
    assert max(r["staleness/max"] for r in steps) == 1  # the rollout ran ahead: asynchronous
    for r in steps:
        assert r["rollout/weight_sync_bytes"] > 0 and r["timing_s/rollout_weight_sync"] > 0
        assert r["timing_s/weight_sync_verify"] > 0  # rollout.verify_sync (the default): every load checked, passed
    scores = [r["critic/score/mean"] for r in steps]
    assert np.mean(scores[-4:]) > np.mean(scores[:4]) + 0.08, scores


def test_a_sync_run_without_ray_runs_the_vllm_engine_in_the_trainers_process(tmp_path):
    out = tmp_path / "sync"
    args = tiny_run(
        out, 6, "ray.enabled=null", "trainer.mode=sync", "trainer.checkpoint_every=3", "rollout.name=vllm", *VLLM_MODEL
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "RAY_ADDRESS": ""}
    done = subprocess.run(
        [sys.executable, "-m", "dppo", "train", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "rollout:" not in done.stdout and "Ray" not in done.stdout  # no worker processes, no Ray: in-process
    steps = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in steps] == list(range(1, 7))
    assert (out / "checkpoints" / "step_00000006").is_dir()  # the engine's process group does not upset a save
    for r in steps:
        assert r["staleness/max"] == 0.0 and r["rollout/weight_sync_bytes"] > 0
        assert abs(r["rollout_corr/kl_k1"]) < 1e-3, r  # an fp32 engine: pi_behav is pi_old up to kernel rounding
