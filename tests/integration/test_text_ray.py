"""`dppo train` on text data with Ray rollout workers, as a user runs it: the example's model, data and reward."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _run(example, output_dir, *extra, timeout=150):
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
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "RAY_ADDRESS": ""}
    return subprocess.run([sys.executable, "-m", "dppo", "train", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout, start_new_session=True)  # fmt: skip


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
