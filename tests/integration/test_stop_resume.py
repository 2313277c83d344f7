"""`dppo train` as a process, stopped: SIGTERM ends a run and its Ray cluster (or, without Ray, its local rollout
worker processes) within 5 s and the run resumes; a sync run SIGKILLed and resumed ends bitwise as if never
interrupted; an async run SIGKILLed and resumed is replayed (`dppo replay`) to its final weights bitwise."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dppo.cli import main
from dppo.commands.replay import replay
from dppo.trainer.schedule import SCHEDULE_FILE

from tiny_run import THRESHOLD, tiny_run  # tests/tiny_run.py (tests/conftest.py puts tests/ on sys.path)

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "RAY_ADDRESS": ""}


def tiny(output_dir: Path, total_steps: int, *extra: str) -> list[str]:
    return tiny_run(output_dir, total_steps, "trainer.eval_prompts=8", "ray.num_cpus=2", *extra)


def records(path: Path) -> list[dict]:
    from dppo.trainer.report import read_metrics

    return read_metrics(path) if path.exists() else []


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


# ---- `dppo train` as a process: SIGTERM, an unreachable cluster, SIGKILL and an exact resume --------------------


def start(args: list[str], log: Path, command: list[str] = ("-m", "dppo", "train")) -> subprocess.Popen:
    with open(log, "wb") as f:
        # A new session: the run and every process it starts (its local Ray cluster) can be found by its id.
        return subprocess.Popen(
            [sys.executable, *command, *args],
            cwd=REPO,
            env=ENV,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


# `dppo train` that SIGKILLs itself inside a chosen trigger, before that trigger trains (argv[1], argv[2]: the
# completed global steps and the trigger; the rest: the run's arguments). In-process runs only (ray.enabled=false):
# the trainer, which this patches, must live in this process. Where it dies is chosen, not raced.
KILLED_AT = """
import os, signal, sys
from dppo.trainer.ppo import PPOTrainer

at = (int(sys.argv[1]), int(sys.argv[2]))
train_trigger = PPOTrainer.train_trigger

def killed_at(self, batch, prox_logp=None):
    if (self.global_step, self.local_trigger_step) == at:
        os.kill(os.getpid(), signal.SIGKILL)
    return train_trigger(self, batch, prox_logp)

PPOTrainer.train_trigger = killed_at
from dppo.cli import main
sys.exit(main(["train", *sys.argv[3:]]))
"""


def session(sid: int) -> list[int]:
    """The live (not zombie) processes of session sid."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,sid=,stat="], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid, s, stat in zip(out[::3], out[1::3], out[2::3]) if int(s) == sid and stat[0] != "Z"]


def kill_session(sid: int) -> None:
    for pid in session(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def stop_with_sigterm(proc: subprocess.Popen, log: Path, what: str) -> None:
    """SIGTERM the run: it and every process of its session (what: in words) are gone within 5 s, exit code 143,
    with one line and no traceback."""
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=30)
    wait_for(lambda: not session(proc.pid), 30, f"{what} to end")
    stopped_s = time.monotonic() - sent
    assert stopped_s < 5.0, stopped_s
    assert code == 143, log.read_text()[-3000:]
    lines = log.read_text().strip().splitlines()
    assert lines[-1].startswith("dppo: stopped by SIGTERM; checkpoints already written are intact")
    assert not any("Traceback" in line for line in lines), lines


def newest_trainer_state(checkpoints: Path) -> dict:
    from dppo.checkpoint import store as ckpt
    from dppo.checkpoint.layout import TRAINER_FILE

    return ckpt.CheckpointDir(checkpoints).newest(lambda path, manifest: ckpt.load_torch(path / TRAINER_FILE))[1]


def test_sigterm_stops_an_async_run_without_ray_and_its_worker_processes_within_5_s(tmp_path):
    """The default on one CPU machine: no Ray, two rollout worker processes. SIGTERM mid-run: the run and its workers
    are gone within 5 s, exit code 143, one line, and the last checkpoint loads."""
    out, log = tmp_path / "run", tmp_path / "local.log"
    proc = start(tiny(out, 1000, "ray.enabled=null", "trainer.checkpoint_every=2", "rollout.num_workers=2"), log)
    try:
        wait_for(lambda: len(records(out / "metrics.jsonl")) >= 3 or proc.poll() is not None, 150, "step 3")
        assert proc.poll() is None, log.read_text()[-3000:]
        assert len(session(proc.pid)) == 3  # the trainer and its two workers, nothing of Ray's
        stop_with_sigterm(proc, log, "the worker processes")
    finally:
        kill_session(proc.pid)
    assert newest_trainer_state(out / "checkpoints")["global_step"] >= 2


def test_sigterm_stops_an_async_run_and_its_ray_cluster_within_5_s_and_the_run_resumes(tmp_path):
    """Two workers (the wait strategy takes groups in grant order, so even then none is dropped); SIGTERM mid-run:
    the run and its local Ray cluster are gone within 5 s, exit code 143, one line; the resumed run keeps the
    steps up to its last checkpoint as they were and redoes only the later ones."""
    out, log = tmp_path / "run", tmp_path / "first.log"
    metrics = out / "metrics.jsonl"
    proc = start(tiny(out, 1000, "trainer.checkpoint_every=2", "rollout.num_workers=2"), log)
    try:
        wait_for(lambda: len(records(metrics)) >= 5 or proc.poll() is not None, 150, "step 5")
        assert proc.poll() is None, log.read_text()[-3000:]
        assert len(session(proc.pid)) > 3  # the driver and its local Ray cluster (GCS, raylet, workers, ...)
        stop_with_sigterm(proc, log, "the Ray processes")
    finally:
        kill_session(proc.pid)
    before = records(metrics)
    last = newest_trainer_state(out / "checkpoints")["global_step"]  # the last checkpoint verifies and loads
    assert last % 2 == 0 and 4 <= last <= len(before)
    total = last + 2

    resumed = subprocess.run(
        [
            sys.executable,
            "-m",
            "dppo",
            "train",
            *tiny(out, total, "trainer.checkpoint_every=2", "rollout.num_workers=2", "trainer.resume=true"),
        ],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=150,
        start_new_session=True,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / f'step_{last:08d}'} (global step {last})" in resumed.stdout
    assert f"metrics: {metrics}" in resumed.stdout and "plot:" in resumed.stdout
    assert (out / "training_curves.png").stat().st_size > 10_000
    after = records(metrics)
    assert [r["step"] for r in after] == list(range(1, total + 1))  # every step once
    assert after[:last] == before[:last]  # steps up to the checkpoint are the stopped run's own lines
    required = [
        "critic/score/mean",
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "staleness/mean",
        "timing_s/step",
        "timing_s/gen_wait",
        "timing_s/old_log_prob",
        "timing_s/snapshot",
        "timing_s/update_actor",
        "rollout_corr/weight_mean",
        "rollout_corr/kl_k1",
        "rollout/worker_restarts",
    ]
    for r in after:
        assert all(key in r for key in required), (r["step"], [k for k in required if k not in r])
        # versions advance once per step and no consumed group is older than allowed
        assert r["version"] == r["step"] and 0.0 <= r["staleness/mean"] <= r["staleness/max"] <= THRESHOLD
        assert r["replay/dropped_total"] == 0.0  # the wait strategy never drops, with any number of workers
    summary = json.loads((out / "summary.json").read_text())
    assert 0.0 <= summary["evaluation"]["eval/accuracy"] <= 1.0


def test_a_sync_run_killed_with_sigkill_resumes_bitwise(tmp_path):
    """trainer.mode=sync on the CPU: a run SIGKILLed inside step 4 (at its trigger 1; checkpoint every 2 steps) and
    resumed ends with the weights and metrics of a run that was never interrupted, bit for bit. The run kills itself
    there (KILLED_AT): no race with a run that could finish first."""
    from dppo.config import load_config
    from dppo.trainer.ppo import PPOTrainer

    total = 6
    sync = ["trainer.mode=sync", "ray.enabled=false", "trainer.checkpoint_every=2"]
    clean = PPOTrainer(load_config(tiny(tmp_path / "clean", total, *sync)))
    clean.fit()
    out, log = tmp_path / "killed", tmp_path / "killed.log"
    proc = start(tiny(out, total, *sync), log, ["-c", KILLED_AT, "3", "1"])  # 3 steps done, step 4's trigger 1
    try:
        proc.wait(timeout=120)
    finally:
        kill_session(proc.pid)
    assert proc.returncode == -signal.SIGKILL, log.read_text()[-3000:]
    assert [r["step"] for r in records(out / "metrics.jsonl")] == [1, 2, 3]
    assert newest_trainer_state(out / "checkpoints")["global_step"] == 2  # what the resumed run starts from
    resumed = subprocess.run(
        [sys.executable, "-m", "dppo", "train", *tiny(out, total, *sync, "trainer.resume=true")],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / 'step_00000002'} (global step 2)" in resumed.stdout
    from dppo.checkpoint.layout import ACTOR_DIR
    from dppo.checkpoint.shards import load_full_weights

    final = newest_trainer_state(out / "checkpoints")
    assert final["global_step"] == total
    weights = load_full_weights(out / "checkpoints" / f"step_{total:08d}" / ACTOR_DIR)
    for name, tensor in clean.actor_group.local_rank.model.state_dict().items():
        assert torch.equal(weights[name], tensor), name
    untimed = lambda rs: [{k: v for k, v in r.items() if not k.startswith("timing_s/")} for r in rs]  # noqa: E731
    assert untimed(records(out / "metrics.jsonl")) == untimed(records(tmp_path / "clean" / "metrics.jsonl"))


# `dppo train` without Ray whose (forked) rollout worker SIGKILLs the trainer inside a partial ticket: each ticket but
# the first waits at its first look for the next publish (one ticket a version: it needs only the tickets before it)
# and goes on under it; the ticket that has just loaded version argv[1] mid-way kills the trainer (the worker then
# dies with it). Chosen, not raced.
KILLED_IN_PARTIAL = """
import dataclasses, os, signal, sys, time
import dppo.workers.rollout.process as process
from dppo.workers.rollout.worker import Weights

kill_at, tickets, looked = int(sys.argv[1]), [0], [0]
real_acquire, real_newer = process.PipeClient.acquire, process.PipeClient.newer

class LoadThenKill(Weights):
    def __init__(self, weights):
        self.weights = weights

    def load_into(self, engine, holds):
        loaded = self.weights.load_into(engine, holds)
        os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(60)  # the trainer's death signal ends this process
        return loaded

def acquire(self, version, num_groups):
    tickets[0] += 1
    return real_acquire(self, version, num_groups)

def newer(self, version):
    if looked[0] != tickets[0]:  # the ticket's first look
        looked[0] = tickets[0]
        deadline = time.monotonic() + 10
        while tickets[0] > 1 and self.published.value <= version and time.monotonic() < deadline:
            time.sleep(0.005)
    found = real_newer(self, version)
    if found is None or found.version < kill_at:
        return found
    return dataclasses.replace(found, weights=LoadThenKill(found.weights))

process.PipeClient.acquire, process.PipeClient.newer = acquire, newer
from dppo.cli import main
sys.exit(main(["train", *sys.argv[2:]]))
"""


def test_a_run_killed_inside_a_partial_ticket_resumes_and_counts_nothing_twice(tmp_path):
    """rollout.partial_rollout, no Ray: the trainer SIGKILLed while its worker generates a ticket that has just gone
    on under version 3 (checkpoint at step 2). The resumed run grants that ticket's groups again from the checkpoint's
    grant index and generates them anew: 6 steps, each of 8 groups taken once (the next grant index 48), none
    dropped."""
    total, groups = 6, 8
    args = tiny(
        tmp_path / "out",
        total,
        "ray.enabled=null",
        "trainer.checkpoint_every=2",
        "rollout.partial_rollout=true",
        "rollout.partial_chunk=1",
        f"rollout.groups_per_batch={groups}",  # trainer.train_batch_size: one ticket a version
    )
    out, log = tmp_path / "out", tmp_path / "killed.log"
    proc = start(args, log, ["-c", KILLED_IN_PARTIAL, "3"])
    try:
        proc.wait(timeout=120)
    finally:
        kill_session(proc.pid)
    assert proc.returncode == -signal.SIGKILL, log.read_text()[-3000:]
    killed = records(out / "metrics.jsonl")
    assert [r["step"] for r in killed] == [1, 2, 3]  # version 3 published: step 3 done, its checkpoint not due
    assert any(r["rollout/partial_frac"] > 0 for r in killed)  # the tickets before went partial too
    assert newest_trainer_state(out / "checkpoints")["global_step"] == 2
    resumed = subprocess.run(
        [sys.executable, "-m", "dppo", "train", *args, "trainer.resume=true"],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / 'step_00000002'} (global step 2)" in resumed.stdout
    steps = records(out / "metrics.jsonl")
    assert [r["step"] for r in steps] == list(range(1, total + 1))
    final = newest_trainer_state(out / "checkpoints")
    assert final["global_step"] == total
    assert final["rollout"]["next_grant"] == total * groups and final["rollout"]["dropped_total"] == 0
    for r in steps:
        assert r["staleness/token_max"] <= r["staleness/max"] <= THRESHOLD and r["replay/dropped_total"] == 0


def test_a_run_killed_and_resumed_replays_to_the_resumed_runs_weights(tmp_path):
    """SIGKILL mid-step 3 (after step 2's checkpoint, with step 3's first lines in the schedule), then
    trainer.resume=true: the schedule is the checkpoint's copy plus the resumed run's lines, and the replay ends where
    the resumed run did."""
    run = tmp_path / "run"
    # the demo (`make demo`: separate_async, a local worker process), its evaluation left out
    args = [f"trainer.output_dir={run}", "trainer.total_steps=5", "trainer.checkpoint_every=2",
            "trainer.progress_bar=false", "trainer.eval_prompts=0"]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "dppo", "train", *args], cwd=REPO, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip

    def recorded_steps() -> list[int]:
        text = (run / SCHEDULE_FILE).read_text() if (run / SCHEDULE_FILE).exists() else ""
        return [json.loads(line)["step"] for line in text.splitlines()[1:] if line.endswith("}")]

    deadline = time.monotonic() + 120
    while 3 not in recorded_steps() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()[-2000:]
    assert 3 in recorded_steps() and not (run / "checkpoints" / "step_00000004").exists()
    assert main(["train", *args, "trainer.resume=true"]) == 0
    assert recorded_steps() == [s for s in (1, 2, 3, 4, 5) for _ in range(4)]  # step 3's first lines: the resumed run's
    result = replay(run, out=tmp_path / "replay")
    assert result.weights_equal and result.metric_differences == [], result.lines()
