"""dppo.stopping: SIGTERM ends the process within the grace time, with 128 + the signal, and takes every process
below it along, also one orphaned on the way and also when the main thread does not give up."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from processes import alive  # tests/processes.py (tests/conftest.py puts tests/ on sys.path)

REPO = Path(__file__).resolve().parents[2]

STUBBORN = """\
import subprocess, sys, time
from dppo.stopping import StopOnSignal

with StopOnSignal(grace_s=1.0) as stop:
    # a child with a child of its own, as the raylet with its agents
    child = subprocess.Popen(["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $! > " + sys.argv[1] + "; wait"])
    try:  # "ready" is printed inside the try: the test signals once it has read it, maybe before print returns
        print("ready", flush=True)
        time.sleep(60)
    except KeyboardInterrupt:  # the clean-up stops the child, orphaning the grandchild (as ray.shutdown
        child.kill()  # does with the agents); then a main thread that does not give up: the grace timer ends it
        print("ignoring", flush=True)
    while True:
        time.sleep(60)
"""


def test_sigterm_ends_a_stubborn_process_and_its_orphans_within_the_grace_time(tmp_path):
    pid_file = tmp_path / "grandchild"
    proc = subprocess.Popen(
        [sys.executable, "-c", STUBBORN, str(pid_file)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert proc.stdout.readline() == "ready\n"
        deadline = time.monotonic() + 10
        while not pid_file.exists() or not pid_file.read_text().strip():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        grandchild = int(pid_file.read_text())
        assert alive(grandchild)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=10)
        assert 0.9 < time.monotonic() - start < 3.0
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM
    assert out == "ignoring\n"
    assert err.strip().splitlines() == [
        "dppo: stopped by SIGTERM; checkpoints already written are intact "
        "(trainer.resume=true continues from the newest)"
    ]
    deadline = time.monotonic() + 2
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(grandchild)
