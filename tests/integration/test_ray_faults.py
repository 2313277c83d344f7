"""`dppo train` as a process, with Ray faults made real at chosen points: a rollout worker killed by Ray's memory
monitor is restarted like any dead worker (one line, naming memory and the process's size; Ray's own death lines
left out), and a driver SIGKILLed mid-run leaves no process of its Ray cluster behind (Ray's agents included)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from integration.test_stop_resume import REPO, ENV, kill_session, records, session, start, tiny

pytestmark = pytest.mark.integration

GiB = 1 << 30

# `dppo train` whose task's reward function, on a rollout worker, first SIGKILLs its own process at its second call
# (the ticket of grant indices 4..7, which step 1 needs): dppo restarts the worker, and the new incarnation, now
# the newest Ray lease on the node (it started after the actor rank and the replay buffer), allocates memory at its
# first call until the node's used memory reaches give_up bytes. Ray's memory monitor, whose threshold the test put
# below that, kills the newest non-retriable worker first: this one. The file hogged holds the bytes allocated so
# far; a hog the monitor spares gives its memory back and raises. argv: killed, hogged, give_up, the run's args.
MEMORY_HOG = """
import os, signal, sys, time
from pathlib import Path
import numpy as np
from dppo.tasks import Task, digit_task, register_task

killed, hogged, give_up = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
driver, calls = os.getpid(), []

def node_used_bytes():
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info["MemTotal"] - info["MemAvailable"]

def hog():
    chunks = []
    while node_used_bytes() < give_up:
        chunks.append(np.ones(32 << 20, np.uint8))  # 32 MiB, touched
        # whole or not at all: the monitor may kill this process between write_text's truncation and its write
        hogged.with_suffix(".part").write_text(str(len(chunks) * (32 << 20)))
        os.replace(hogged.with_suffix(".part"), hogged)
    time.sleep(5)  # the monitor looks every 50 ms: not killed by now, it will not be
    chunks.clear()
    raise RuntimeError("Ray's memory monitor did not kill the rollout worker")

def make(length):
    copy = digit_task("hog_copy", length, lambda d: d)

    def reward_fn(prompts, responses, mask):
        calls.append(1)
        if os.getpid() != driver and not killed.exists() and len(calls) == 2:
            killed.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        if os.getpid() != driver and killed.exists() and not hogged.exists():
            hog()
        return copy.reward_fn(prompts, responses, mask)

    return Task("hog_copy", copy.prompt_fn, reward_fn, copy.answer_length, copy.vocab_size)

register_task("hog_copy", make)
from dppo.cli import main
sys.exit(main(["train", *sys.argv[4:]]))
"""


def node_memory() -> tuple[int, int]:
    """(used, total) bytes of this machine's memory, as Ray's memory monitor counts them (total - available)."""
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info["MemTotal"] - info["MemAvailable"], info["MemTotal"]


def test_a_rollout_worker_killed_by_rays_memory_monitor_is_restarted_with_one_line(tmp_path):
    """Ray's memory monitor (its threshold set 5 GiB above what the machine uses before the run, which the tiny run's
    processes do not reach) kills the rollout worker that allocates past it: Ray's OutOfMemoryError is a worker
    death, so the worker is restarted and the run finishes; the line says memory and the killed process's size,
    and Ray's own lines for either death are not printed. Other sessions on a shared machine may push it past the
    threshold too: the monitor then kills the newest worker again (restarts to spare: rollout.max_restarts=10), each
    kill a line of its own."""
    used, total = node_memory()
    threshold = used + 5 * GiB
    assert threshold + 2 * GiB < total, f"this test needs about 7 GiB free; the machine uses {used / GiB:.1f} GiB"
    env = {
        **ENV,
        "RAY_memory_usage_threshold": f"{threshold / total:.4f}",
        "RAY_memory_monitor_refresh_ms": "50",
        "RAY_max_kill_memory_buffer_bytes": "0",
    }
    out, log, killed, hogged = tmp_path / "run", tmp_path / "run.log", tmp_path / "killed", tmp_path / "hogged"
    args = tiny(
        out, 3, "task.name=hog_copy", "rollout.num_workers=1", "trainer.checkpoint_every=0", "rollout.max_restarts=10"
    )
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-c", MEMORY_HOG, str(killed), str(hogged), str(int(threshold + 1.5 * GiB)), *args],
            cwd=REPO,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        code = proc.wait(timeout=240)
    finally:
        kill_session(proc.pid)
    text = log.read_text()
    assert code == 0, text[-3000:]
    died, *memory_kills = [line for line in text.splitlines() if line.startswith("dppo: ")]
    assert died.startswith("dppo: warning: rollout worker 0 died; restarted it (1 of rollout.max_restarts=10)"), died
    memory = "dppo: warning: rollout worker 0 was killed for memory by Ray's memory monitor (its process used "
    assert memory_kills and all(line.startswith(memory) and "; restarted it (" in line for line in memory_kills)
    sizes = [line[len(memory) :].split(";")[0].split(")")[0] for line in memory_kills]
    assert all(size.endswith("GB") for size in sizes), sizes
    assert max(float(size[:-2]) for size in sizes) >= 0.9 * int(hogged.read_text()) / 1e9, (sizes, hogged.read_text())
    assert "A worker died or was killed" not in text and "killed due to memory pressure" not in text, text[-3000:]
    steps = records(out / "metrics.jsonl")
    assert [r["step"] for r in steps] == [1, 2, 3] and steps[-1]["rollout/worker_restarts"] == 1 + len(memory_kills)


# `dppo train` on Ray that SIGKILLs itself inside a chosen trigger (argv[1], argv[2]: the completed global steps and
# the trigger; the rest: the run's arguments), once it has printed the pids below it (its local Ray cluster).
RAY_KILLED_AT = """
import os, signal, sys
from dppo.stopping import descendants
from dppo.trainer.ppo import PPOTrainer

at = (int(sys.argv[1]), int(sys.argv[2]))
train_trigger = PPOTrainer.train_trigger

def killed_at(self, batch, prox_logp=None):
    if (self.global_step, self.local_trigger_step) == at:
        print("below:", *descendants(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return train_trigger(self, batch, prox_logp)

PPOTrainer.train_trigger = killed_at
from dppo.cli import main
sys.exit(main(["train", *sys.argv[3:]]))
"""


def marked(driver: int) -> list[int]:
    """Live processes whose environment or command line names a Ray cluster the process driver started
    (ray_cluster.CLUSTER_ENV's marker: dppo-<driver pid>-...): its Ray processes and its watchdog."""
    found, marker = [], f"dppo-{driver}-".encode()
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/environ", "rb") as env, open(f"/proc/{name}/cmdline", "rb") as cmd:
                if marker in env.read() or marker in cmd.read():
                    with open(f"/proc/{name}/stat") as stat:
                        if stat.read().rsplit(")", 1)[1].split()[0] != "Z":
                            found.append(int(name))
        except (OSError, ValueError):
            pass
    return found


def command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()[:80].replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "(gone)"


def test_a_sigkilled_driver_leaves_no_ray_process_behind_after_5_s(tmp_path):
    """The driver SIGKILLs itself inside step 2: within 5 s no process of its session and none of its Ray cluster is
    left (without the watchdog Ray's DashboardAgent and RuntimeEnvAgent live on for about a minute)."""
    out, log = tmp_path / "run", tmp_path / "run.log"
    proc = start(
        tiny(out, 4, "rollout.num_workers=1", "trainer.checkpoint_every=0"), log, ["-c", RAY_KILLED_AT, "1", "0"]
    )
    try:
        proc.wait(timeout=150)
        killed = time.monotonic()
        assert proc.returncode == -signal.SIGKILL, log.read_text()[-3000:]
        [below] = [line.split()[1:] for line in log.read_text().splitlines() if line.startswith("below:")]
        assert len(below) >= 5  # GCS, raylet, agents, the rank, the buffer, the worker, ...
        left = lambda: sorted(set(session(proc.pid) + marked(proc.pid)))  # noqa: E731
        while left() and time.monotonic() - killed < 5.0:
            time.sleep(0.1)
        remaining = {pid: command(pid) for pid in left()}
    finally:
        kill_session(proc.pid)
        for pid in marked(proc.pid):
            os.kill(pid, signal.SIGKILL)
    assert not remaining, remaining
