"""A reward whose extra keys some responses lack, across the evaluation's decode batches: a key that no row of a batch
has is NaN on that batch's rows, and every metric is the mean over the rows that have it, per data source, in the
trainer's final evaluation (hf_model/ and summary.json still written), in `dppo eval` greedy and sampled, and in the
training metrics (reward/extra/<key>)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dppo.batch import Group
from dppo.data.source import Scores
from dppo.trainer import base
from dppo.trainer.evaluation import EVAL_BATCH
from dppo.trainer.ppo import PPOTrainer

NUM_VAL = EVAL_BATCH + 8  # two greedy decode batches: rows 0..511 and 512..519

# early: rows of the first batch only (index 4k and 4k+1), index/512; late: three rows of the last batch, (index-512)^2/16
SPARSE_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    index = extra_info["index"]
    result = {"score": float(solution_str.strip() == ground_truth)}
    if index < 512 and index % 4 in (0, 1):
        result["early"] = index / 512
    if index in (513, 514, 515):
        result["late"] = (index - 512) ** 2 / 16
    return result
"""


def expected_extras(prefix: str = "val") -> dict[str, float]:
    """The per-source means over the rows that have each key, by hand: rows alternate reverse_short (even index) and
    reverse_long (odd), as examples/text_reverse.make_rows writes them."""
    short, long = range(0, NUM_VAL, 2), range(1, NUM_VAL, 2)

    def early(rows):
        return float(np.mean([i / 512 for i in rows if i < 512 and i % 4 in (0, 1)]))

    return {
        f"{prefix}/early/reverse_short": early(short),  # 254 / 512
        f"{prefix}/early/reverse_long": early(long),  # 255 / 512
        f"{prefix}/late/reverse_short": 4 / 16,  # row 514
        f"{prefix}/late/reverse_long": (1 / 16 + 9 / 16) / 2,  # rows 513 and 515
    }


@pytest.fixture(scope="module")
def sparse_data(text_example, tmp_path_factory):
    """The example's model and training file, NUM_VAL validation rows and SPARSE_REWARD: {"model", "train", "val",
    "reward"} -> Path."""
    example = text_example["module"]
    root = tmp_path_factory.mktemp("sparse")
    val = example.write_parquet(root / "val.parquet", example.make_rows(np.random.default_rng(1), NUM_VAL, "val"))
    reward = root / "sparse_reward.py"
    reward.write_text(SPARSE_REWARD)
    return {"model": text_example["model"], "train": text_example["train"], "val": val, "reward": reward}


@pytest.fixture(scope="module")
def sparse_run(sparse_data, tmp_path_factory):
    """A one-step in-process text run on sparse_data; the trainer and fit()'s RunResult."""
    from tiny_run import text_overrides

    from dppo.config import load_config

    cfg = load_config(text_overrides(tmp_path_factory.mktemp("sparse_run"), sparse_data, **{"trainer.total_steps": 1}))
    trainer = PPOTrainer(cfg)
    return trainer, trainer.fit()


def present(metrics: dict[str, float], keys) -> dict[str, float]:
    return {key: metrics[key] for key in keys if key in metrics}


def test_scores_concat_fills_a_key_a_part_lacks_with_nan_on_its_rows():
    a = Scores(np.array([1, 2], np.float32), {"acc": np.array([1, np.nan], np.float32)})
    b = Scores(np.array([3], np.float32), {})
    c = Scores(np.array([4, 5], np.float32), {"acc": np.array([0, 1], np.float32), "fmt": np.ones(2, np.float32)})
    every = Scores.concat([a, b, c])
    np.testing.assert_array_equal(every.scores, [1, 2, 3, 4, 5])
    np.testing.assert_array_equal(every.extra["acc"], [1, np.nan, np.nan, 0, 1])
    np.testing.assert_array_equal(every.extra["fmt"], [np.nan, np.nan, np.nan, 1, 1])
    assert sorted(every.extra) == ["acc", "fmt"] and every.extra["acc"].dtype == np.float32


def test_the_final_evaluation_averages_each_extra_over_the_rows_that_have_it_and_the_run_writes_its_outputs(
    sparse_run,
):
    """Rows 0..511 and 512..519 are decoded and scored apart; early is missing from the second batch, late from the
    first: the run still writes hf_model/ and summary.json, with the hand-computed means per data source."""
    trainer, result = sparse_run
    expected = expected_extras()
    assert present(result.evaluation, expected) == pytest.approx(expected, rel=1e-6)
    assert {"val/score/reverse_short", "val/score/reverse_long"} <= set(result.evaluation)
    assert (result.hf_model_path / "model.safetensors").is_file() and result.hf_model_path.name == "hf_model"
    summary = json.loads(result.summary_path.read_text())
    assert present(summary["evaluation"], expected) == pytest.approx(expected, rel=1e-6)
    assert result.records[-1]["val/late/reverse_long"] == result.evaluation["val/late/reverse_long"]
    # training's reward/extra/early: its groups come from batches of 2 prompts, some without the key at all
    extras = [r["reward/extra/early"] for r in result.records if "reward/extra/early" in r]
    assert extras and all(0.0 <= value <= 255 / 512 for value in extras)


def test_dppo_eval_greedy_and_sampled_over_several_batches_averages_the_rows_that_have_each_extra(
    sparse_data, tmp_path, capsys
):
    """The command on the example's model directory: greedy (2 batches) and rollout.n=8 (512 // 8 = 64 prompts a batch, 9
    batches); every response of a row has its row's extras, so the means and their best of 8 are those by hand."""
    from dppo.cli import main

    data = [
        f"data.val_files={sparse_data['val']}",
        f"custom_reward_function.path={sparse_data['reward']}",
        "data.max_prompt_length=32",
        "data.max_response_length=6",  # as the run's (the default decodes hundreds of tokens)
    ]
    expected = expected_extras()
    assert main(["eval", str(sparse_data["model"]), "--out", str(tmp_path / "greedy.json"), *data]) == 0
    greedy = json.loads((tmp_path / "greedy.json").read_text())
    assert greedy["prompts"] == NUM_VAL and present(greedy["metrics"], expected) == pytest.approx(expected, rel=1e-6)
    sampled_args = [*data, "rollout.n=8", "rollout.temperature=1.0"]
    assert main(["eval", str(sparse_data["model"]), "--out", str(tmp_path / "n8.json"), *sampled_args]) == 0
    sampled = json.loads((tmp_path / "n8.json").read_text())["metrics"]
    best = {key.replace("val/", "val/best@8/", 1): value for key, value in expected.items()}
    assert present(sampled, expected) == pytest.approx(expected, rel=1e-6)
    assert present(sampled, best) == pytest.approx(best, rel=1e-6)
    assert "written:" in capsys.readouterr().out


def group(extra: dict[str, list[float]], n: int = 2) -> Group:
    return Group(
        torch.zeros(3, dtype=torch.long),
        torch.zeros(n, 2, dtype=torch.long),
        torch.ones(n, 2, dtype=torch.bool),
        torch.zeros(n, 2),
        torch.zeros(n),
        0,
        reward_extra={key: torch.tensor(values, dtype=torch.float32) for key, values in extra.items()},
    )


def test_reward_extras_average_the_responses_that_have_each_key_and_leave_out_a_key_none_has():
    """Groups scored in different batches: one without the key at all, one with NaN rows; a key whose every value is
    NaN in these groups (others of its batch had it) is not logged as NaN."""
    groups = [
        group({"acc": [1.0, float("nan")], "fmt": [float("nan"), float("nan")]}),
        group({}),
        group({"acc": [0.0, 0.0]}),
    ]
    assert base._reward_extras(groups) == pytest.approx({"reward/extra/acc": 1 / 3}, rel=1e-6)
