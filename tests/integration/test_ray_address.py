"""`dppo train ray.address=...` joins a Ray cluster someone else started, as on a multi-node cluster: a head
started with `ray start` and token authentication on; the job trains on it and leaves it up; a job without
the cluster's token gets dppo's one-line error."""

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(env: dict, address: str, output_dir: Path) -> subprocess.CompletedProcess:
    args = [
        f"ray.address={address}",
        f"trainer.output_dir={output_dir}",
        "trainer.total_steps=2",
        "trainer.parameter_sync_step=2",
        "trainer.train_batch_size=4",
        "trainer.eval_prompts=8",
        "trainer.checkpoint_every=0",
        "trainer.progress_bar=false",
        "rollout.n=4",
        "rollout.groups_per_batch=2",
        "task.length=3",
        "model.hidden_size=32",
        "model.num_hidden_layers=1",
        "model.num_attention_heads=2",
        "model.intermediate_size=64",
    ]
    return subprocess.run(
        [sys.executable, "-m", "dppo", "train", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


def test_dppo_train_joins_a_cluster_started_with_ray_start(tmp_path):
    port = free_port()
    address = f"127.0.0.1:{port}"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(REPO),
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
    }
    env.pop("RAY_ADDRESS", None)
    head = [
        RAY,
        "start",
        "--head",
        f"--port={port}",
        "--num-cpus=2",
        "--include-dashboard=false",
        "--disable-usage-stats",
    ]
    # In a session of its own, so that its daemons can be stopped by their session id at the end: `ray stop`
    # would end every Ray cluster on the machine, other test runs' included.
    starter = subprocess.Popen(head, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    output, _ = starter.communicate(timeout=120)
    assert starter.returncode == 0, output[-4000:]
    try:
        job = train(env, address, tmp_path / "run")
        assert job.returncode == 0, job.stderr[-4000:]
        records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [1, 2]
        assert f"metrics: {tmp_path / 'run' / 'metrics.jsonl'}" in job.stdout
        # the job disconnected without shutting the cluster down: it is there for the next job
        status = subprocess.run([RAY, "status", f"--address={address}"], env=env, capture_output=True, timeout=60)
        assert status.returncode == 0, status.stderr[-2000:]
        # a job that does not hold the cluster's token is refused, in one line naming the address
        refused = train({**env, "RAY_AUTH_TOKEN": "not-the-token"}, address, tmp_path / "refused")
        assert refused.returncode == 5, refused.stderr[-4000:]  # exit code 5: the cluster cannot be joined
        last = refused.stderr.strip().splitlines()[-1]
        assert last.startswith(f"dppo: error: could not join the Ray cluster at '{address}'"), refused.stderr[-4000:]
        assert "Traceback" not in refused.stderr
    finally:
        stop_session(starter.pid)


def session(sid: int) -> list[int]:
    """The live (not zombie) processes of session sid."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,sid=,stat="], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid, s, stat in zip(out[::3], out[1::3], out[2::3]) if int(s) == sid and stat[0] != "Z"]


def stop_session(sid: int, grace_s: float = 3.0) -> None:
    """SIGTERM the processes of session sid (the cluster `ray start` left running), SIGKILL what outlives grace_s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in session(sid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while session(sid) and time.monotonic() < deadline:
            time.sleep(0.2)
