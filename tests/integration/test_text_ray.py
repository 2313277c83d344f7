"""`dppo train` on text data with Ray rollout workers, as a user runs it: the example's model, data and reward."""

import json
import os
import subprocess
import time
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _run(example, output_dir, *extra, timeout=150):
    return subprocess.run(
        _command(example, output_dir, *extra),
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=True,
    )


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "RAY_ADDRESS": ""}


def _command(example, output_dir, *extra) -> list[str]:
    args = [
        f"model.path={example['model']}",
        f"data.train_files={example['train']}",
        f"data.val_files={example['val']}",
        "data.max_prompt_length=32",
        "data.max_response_length=6",
        f"custom_reward_function.path={example['reward']}",
        f"trainer.output_dir={output_dir}",
        "trainer.total_steps=3",
        "trainer.parameter_sync_step=2",
        "trainer.train_batch_size=8",
        "trainer.checkpoint_every=0",
        "trainer.progress_bar=false",
        "rollout.n=4",
        "rollout.groups_per_batch=4",
        "ray.num_cpus=2",
        *extra,
    ]
    return [sys.executable, "-m", "dppo", "train", *args]


def test_separate_async_text_run_on_ray(text_example, tmp_path):
    out = tmp_path / "run"
    run = _run(text_example, out, "trainer.test_freq=2")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert 0.0 <= r["critic/score/mean"] <= 1.0 and 0.0 <= r["staleness/max"] <= 1
        assert "reward/extra/exact_match" in r and r["timing_s/old_log_prob"] > 0
    assert {"val/score/reverse_short", "val/score/reverse_long"} <= set(records[1]) & set(records[2])
    assert "greedy val/score/reverse_long" in run.stdout


def test_a_reward_that_never_returns_on_a_ray_worker_ends_the_run_within_its_time_limit(text_example, tmp_path):
    """custom_reward_function.timeout_s on a rollout worker: the call is stopped and the run ends as for a raising
    reward (one line naming the function, the data source and the row; exit code 1): its error line within the
    limit + 10 s of the call (the process then exits once Ray has shut down)."""
    started = tmp_path / "reward_started"
    reward = tmp_path / "hanging_reward.py"
    reward.write_text(
        "import pathlib, time\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        f"    pathlib.Path({str(started)!r}).touch()\n"
        "    time.sleep(10**6)\n"
    )
    command = _command(
        text_example,
        tmp_path / "run",
        f"custom_reward_function.path={reward}",
        "custom_reward_function.timeout_s=3",
        "rollout.num_workers=1",
    )
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        env=_env(),
        text=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    lines, error_at = [], None
    for line in proc.stderr:  # as they come, noting when the error line came
        lines.append(line.rstrip("\n"))
        if line.startswith("dppo: error:"):
            error_at = time.time()
    assert proc.wait(timeout=60) == 1, "\n".join(lines[-40:])
    assert error_at is not None and error_at - started.stat().st_mtime < 3 + 10
    assert lines[-1].startswith(
        f"dppo: error: rollout worker 0 raised RewardFunctionError: reward function "
        f"'compute_score' in {str(reward)!r} did not return within 3 s "
        "(custom_reward_function.timeout_s) (data_source="
    )
    assert not any("Traceback" in line for line in lines)
