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


# `dppo train` that prints how each local rollout worker was started, read from the worker's own /proc/<pid>/cmdline
# once the trainer has fetched groups (so the worker has run): a forked worker still has this process's command line
# (this script's), a spawned one is a fresh interpreter running multiprocessing's spawn_main.
_REPORT_WORKER_STARTS = textwrap.dedent("""
    import sys
    from pathlib import Path
    from dppo.cli import main
    from dppo.trainer.rollout.local_source import LocalRollout

    fetch, seen, ours = LocalRollout.fetch, set(), Path("/proc/self/cmdline").read_bytes()

    def reporting_fetch(self, *args, **kwargs):
        taken = fetch(self, *args, **kwargs)
        for worker in self.workers:
            if worker.process.pid not in seen:
                seen.add(worker.process.pid)
                theirs = Path(f"/proc/{worker.process.pid}/cmdline").read_bytes()
                spawned = theirs != ours and b"from multiprocessing.spawn import spawn_main" in theirs
                how = "fork" if theirs == ours else "spawn" if spawned else repr(theirs)
                print(f"test: rollout worker {worker.index} started by {how}", file=sys.stderr)
        return taken

    LocalRollout.fetch = reporting_fetch
    sys.exit(main(["train", *sys.argv[1:]]))
""")


def _train_reporting_worker_starts(args: list[str]) -> tuple[subprocess.CompletedProcess, list[str]]:
    """`dppo train args` in a process of its own (a fresh run's workers are forked from it: no other thread has run
    there), and how each of its rollout workers was started."""
    run = subprocess.run(
        [sys.executable, "-c", _REPORT_WORKER_STARTS, *args],
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "RAY_ADDRESS": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run, re.findall(r"test: rollout worker \d+ started by (.+)", run.stderr)


def test_a_resumed_run_spawns_its_workers_and_goes_on(tmp_path):
    """The fresh run forks its worker (the control: the same process would fork the resumed run's too, were it allowed);
    the resumed run, whose rollout starts after the actor's rank was built, spawns it, and trains steps 3 and 4."""
    out = tmp_path / "out"
    _, fresh = _train_reporting_worker_starts(overrides(out, 2))
    assert fresh == ["fork"]
    resumed_run, resumed = _train_reporting_worker_starts(overrides(out, 4, "trainer.resume=true"))
    assert resumed == ["spawn"]
    assert "resumed from" in resumed_run.stdout and "(global step 2)" in resumed_run.stdout
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]


# `dppo train` with rollout.partial_rollout made to happen at every ticket: a forked worker's first look of each ticket
# but the first waits (at most 10 s) until the trainer has published a version newer than the one it generates with, so
# those tickets go on under newer weights after their first token (an event the trainer's publish controls, not
# timing). One ticket a version (rollout.groups_per_batch = trainer.train_batch_size): the worker's k-th ticket is
# consumed at version k - 1, so the publish it waits for needs only the tickets before it (the first one's, consumed
# at version 0, is needed for the first publish: it does not wait). A process of its own: its workers must be forked
# from it (a process that ran other runs may have to spawn them, without this patch).
_EVERY_TICKET_PARTIAL = textwrap.dedent("""
    import sys, time
    import dppo.workers.rollout.process as process
    from dppo.cli import main

    real_acquire, real_newer, tickets, looked = process.PipeClient.acquire, process.PipeClient.newer, [0], [0]

    def acquire(self, version, num_groups):
        tickets[0] += 1
        return real_acquire(self, version, num_groups)

    def newer(self, version):
        if looked[0] != tickets[0]:  # the ticket's first look
            looked[0] = tickets[0]
            deadline = time.monotonic() + 10
            while tickets[0] > 1 and self.published.value <= version and time.monotonic() < deadline:
                time.sleep(0.005)
        return real_newer(self, version)

    process.PipeClient.acquire, process.PipeClient.newer = acquire, newer
    sys.exit(main(["train", *sys.argv[1:]]))
""")


def test_an_async_run_with_partial_rollouts_learns_the_demo(tmp_path):
    """The copy task, async without Ray, every ticket but the first resumed under the next version after its first
    token: a random policy scores about 0.1; 60 steps brought the mean of the last 10 to 0.90 (2026-12-03, 6 s of
    steps; the same run without partial rollouts 0.69). Fails with partial rollouts off (the partial fraction)."""
    out = tmp_path / "out"
    args = tiny_run(
        out,
        60,
        "ray.enabled=null",
        "trainer.checkpoint_every=0",
        "trainer.eval_prompts=0",
        "trainer.train_batch_size=32",
        "rollout.n=8",
        "rollout.groups_per_batch=32",
        "model.hidden_size=64",
        "model.num_hidden_layers=2",
        "model.num_attention_heads=4",
        "model.intermediate_size=128",
        "actor.lr=0.003",
        "actor.micro_batch_size=256",
        "actor.optim.lr_scheduler_type=constant",
        "actor.optim.lr_warmup_steps_ratio=0",
        "rollout.partial_rollout=true",
        "rollout.partial_chunk=1",
    )
    run = subprocess.run(
        [sys.executable, "-c", _EVERY_TICKET_PARTIAL, *args],
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "RAY_ADDRESS": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    steps = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in steps] == list(range(1, 61))
    scores = [r["critic/score/mean"] for r in steps]
    first, last = sum(scores[:10]) / 10, sum(scores[-10:]) / 10
    assert first < 0.2 and last >= 0.35, (first, last, scores)
    # the responses went on under newer weights: their later tokens are newer than the group's start version
    assert sum(r["rollout/partial_frac"] for r in steps) / len(steps) > 0.5, [r["rollout/partial_frac"] for r in steps]
    for r in steps:
        assert r["staleness/token_max"] <= r["staleness/max"] <= THRESHOLD  # the bound holds on the oldest token
        assert r["staleness/token_mean"] <= r["staleness/mean"]
        assert r["replay/dropped_total"] == 0
