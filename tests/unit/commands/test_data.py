"""`dppo data reasoning-gym`: verl-format parquet of a reasoning-gym dataset that dppo's parquet path reads, holding
the problems data.source=reasoning_gym generates for the same seed, scored by examples/reasoning_gym_reward.py with
the dataset's own verifier; bad names and an existing output are one line each."""

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from tiny_run import text_overrides

from dppo.cli import main
from dppo.config import load_config
from dppo.data import make_prompt_source
from dppo.data.reasoning_gym import generate

REWARD = Path(__file__).resolve().parents[3] / "examples" / "reasoning_gym_reward.py"
CONFIG = {"min_terms": 2, "max_terms": 2, "max_digits": 2, "operators": ["+", "-"]}
FLAGS = [
    "--config",
    "min_terms=2",
    "--config",
    "max_terms=2",
    "--config",
    "max_digits=2",
    "--config",
    "operators=[+,-]",
]


def test_the_parquet_holds_the_generated_problems_in_verls_format(tmp_path, capsys):
    out = tmp_path / "train.parquet"
    assert (
        main(
            [
                "data",
                "reasoning-gym",
                "basic_arithmetic",
                str(out),
                "--size",
                "12",
                "--seed",
                "5",
                *FLAGS,
                "--prompt-suffix",
                "Give only the number.",
            ]
        )
        == 0
    )
    assert "wrote" in capsys.readouterr().out
    rows = pq.read_table(out).to_pylist()
    entries = generate("basic_arithmetic", CONFIG, 12, seed=5)  # what data.source=reasoning_gym takes at seed 5
    assert len(rows) == 12
    for index, (row, entry) in enumerate(zip(rows, entries)):
        assert row["prompt"] == [{"role": "user", "content": f"{entry['question']} Give only the number."}]
        assert row["data_source"] == "basic_arithmetic" and row["ability"] == "arithmetic"
        assert row["reward_model"] == {"style": "rule", "ground_truth": entry["answer"]}
        info = row["extra_info"]
        assert (info["split"], info["index"], info["seed"], json.loads(info["config"])) == ("train", index, 5, CONFIG)
        assert json.loads(info["entry"]) == json.loads(json.dumps(entry))


def test_dppos_parquet_path_scores_it_with_the_datasets_verifier(tmp_path, tiny_smollm):
    out = tmp_path / "train.parquet"
    assert main(["data", "reasoning-gym", "basic_arithmetic", str(out), "--size", "8", *FLAGS]) == 0
    files = {"model": tiny_smollm["model"], "train": out, "val": out, "reward": REWARD}
    cfg = load_config(text_overrides(tmp_path, files, **{"data.max_prompt_length": 96}))
    source = make_prompt_source(cfg)
    rows = source.eval_prompts()[:2]
    answers = [row.ground_truth for row in rows.meta]
    texts = [f"The answer is {answers[0]}.", f"The answer is {int(answers[1]) + 1}."]
    ids = [source.tokenizer(t, add_special_tokens=False)["input_ids"] + [source.eos_token] for t in texts]
    width = max(map(len, ids))
    responses = np.array([r + [source.pad_token] * (width - len(r)) for r in ids])
    mask = np.array([[True] * len(r) + [False] * (width - len(r)) for r in ids])
    assert source.score(rows, responses, mask).scores.tolist() == [1.0, 0.0]


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dppo: error: "), err
    return err[0]


def test_a_bad_name_or_setting_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "x.parquet"
    assert main(["data", "reasoning-gym", "basic_arithmetc", str(out)]) == 2
    assert "did you mean basic_arithmetic" in one_error_line(capsys)
    assert main(["data", "reasoning-gym", "chain_sum", str(out), "--config", "min_term=3"]) == 2
    assert "has no setting 'min_term'; did you mean min_terms" in one_error_line(capsys)
    assert main(["data", "reasoning-gym", "chain_sum", str(out), "--size", "0"]) == 2
    assert "--size=0" in one_error_line(capsys)
    assert list(tmp_path.iterdir()) == []


def test_an_existing_file_is_replaced_only_with_force(tmp_path, capsys):
    out = tmp_path / "x.parquet"
    out.write_text("mine")
    assert main(["data", "reasoning-gym", "chain_sum", str(out), "--size", "3"]) == 3
    assert "exists; pass --force to replace it" in one_error_line(capsys)
    assert out.read_text() == "mine"
    assert main(["data", "reasoning-gym", "chain_sum", str(out), "--size", "3", "--force"]) == 0
    assert pq.read_table(out).num_rows == 3 and sorted(p.name for p in tmp_path.iterdir()) == ["x.parquet"]
