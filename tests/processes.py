"""Process helpers the tests share."""

import os
import re
import signal
import time
from pathlib import Path

# What `dppo train` prints for its one local rollout worker (no Ray)
LOCAL_WORKER = re.compile(r"rollout: 1 worker process\(es\) on this machine, no Ray \(pid (\d+)\)")


def alive(pid: int) -> bool:
    """pid is a process that has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def kill_the_local_worker_mid_run(proc, metrics: Path, after_steps: int, wait_s: float) -> str:
    """SIGKILL the local rollout worker that the `dppo train` subprocess proc (stdout and stderr piped, text)
    announces, once metrics holds after_steps steps (within wait_s), then wait for the run to end: its stderr.
    proc is killed whatever happens."""
    from dppo.trainer.report import read_metrics

    try:
        worker = None
        for line in proc.stdout:
            if found := LOCAL_WORKER.search(line):
                worker = int(found[1])
                break
        assert worker is not None, "no local rollout worker announced (did the run start Ray?)"
        deadline = time.monotonic() + wait_s
        while not metrics.exists() or len(read_metrics(metrics)) < after_steps:
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()[-3000:]
            time.sleep(0.05)
        os.kill(worker, signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
        return err
    finally:
        proc.kill()
