"""data.source=reasoning_gym: reasoning-gym problems through the model's chat template, rewarded by their dataset's
own verifier, held out by seed; a bad dataset or setting is one line before anything starts; and a 3-step run on a
tiny SmolLM2-shaped model that went through `dppo import-gguf`."""

import json
import logging
import pickle
import shutil
import sys

import cloudpickle
import numpy as np
import pytest
from tiny_run import BASIC_ARITHMETIC, reasoning_gym_overrides
from transformers import AutoTokenizer

from dppo.cli import main
from dppo.config import ConfigError, load_config
from dppo.data import make_prompt_source
from dppo.data.reasoning_gym import ReasoningGymSource, extract_answer, generate
from dppo.data.source import Prompts
from dppo.launch.preflight import check_prompt_source

CONFIG = {**BASIC_ARITHMETIC, "operators": ["+", "-"]}


@pytest.fixture
def rg_args(tmp_path, tiny_smollm):
    return lambda **extra: reasoning_gym_overrides(tmp_path, tiny_smollm["model"], **extra)


@pytest.fixture
def source(rg_args) -> ReasoningGymSource:
    return make_prompt_source(load_config(rg_args(**{"data.reasoning_gym.prompt_suffix": "Give only the number."})))


@pytest.mark.parametrize("response, expected, answer", [
    ("<answer>19</answer> or maybe 20", "19", "19"),  # 1. the last <answer> tags, whatever follows
    ("<answer>7</answer> no, <answer> 8 </answer>", "8", "8"),
    ("12 + 7 = 19", "19", "19"),  # 2. a numeric answer: the last number
    ("The answer is -5.", "-5", "-5"),
    ("That makes 1,250 apples", "1250", "1250"),  # commas dropped when the expected answer has none
    ("The answer is: (2+3)*4.\nDone", "(2+3)*4", "(2+3)*4"),  # 3. after the last "answer:" / "answer is"
    ("Answer: Paris", "London", "Paris"),
    ("  just text  ", "x", "just text"),  # 4. the whole response, stripped
    ("no number here", "7", "no number here"),
])  # fmt: skip
def test_the_answer_is_taken_by_the_documented_rules(response, expected, answer):
    assert extract_answer(response, expected) == answer


def scored(source, rows: Prompts, texts: list[str]) -> np.ndarray:
    """source.score of responses that decode to texts (each ended by the EOS, right-padded): the scores."""
    return scores_of(source, rows, texts).scores


def scores_of(source, rows: Prompts, texts: list[str]):
    """source.score of responses that decode to texts: the Scores (the extras too)."""
    ids = [source.tokenizer(text, add_special_tokens=False)["input_ids"] + [source.eos_token] for text in texts]
    width = max(map(len, ids))
    responses = np.full((len(ids), width), source.pad_token, dtype=np.int64)
    mask = np.zeros((len(ids), width), dtype=bool)
    for i, row in enumerate(ids):
        responses[i, : len(row)], mask[i, : len(row)] = row, True
    return source.score(rows, responses, mask)


def test_rewards_are_the_datasets_verifier_on_the_extracted_answer(source):
    rows = source.eval_prompts()[:1].repeat(4)
    entry = rows.meta[0].extra_info
    answer = entry["answer"]
    wrong = str(int(answer) + 1)
    texts = [
        f"{entry['question'].removeprefix('Calculate ').rstrip('.')} = {answer}",
        f"The answer is {wrong}.",
        f"<answer>{answer} apples</answer>",
        f"<answer>{answer}</answer>",
    ]
    import reasoning_gym  # here, not at the top: .venv-vllm (make test-vllm) collects this module without it

    verifier = reasoning_gym.create_dataset("basic_arithmetic", **CONFIG)
    expected = [1.0, 0.0, len(answer) / len(f"{answer} apples"), 1.0]  # the verifier's own partial credit
    assert [verifier.score_answer(extract_answer(t, answer), entry) for t in texts] == expected
    assert scored(source, rows, texts).tolist() == pytest.approx(expected, abs=0)
    # acc: whether the verifier gave full marks (the exact accuracy the partial credit of the third hides)
    assert scores_of(source, rows, texts).extra["acc"].tolist() == [1.0, 0.0, 0.0, 1.0]
    # what a rollout worker gets: the source pickled (the dataset is built again there)
    copy = pickle.loads(cloudpickle.dumps(source))
    assert copy.reward.builtin._datasets == {}
    assert scored(copy, rows, texts).tolist() == scored(source, rows, texts).tolist()


def test_prompts_are_the_chat_template_of_the_question_and_suffix(source, tiny_smollm):
    tokenizer = AutoTokenizer.from_pretrained(tiny_smollm["model"])
    entries = generate("basic_arithmetic", CONFIG, 64, seed=0)  # data.reasoning_gym.seed null: trainer.seed 0
    held_out = {e["question"] for e in generate("basic_arithmetic", CONFIG, 8, seed=64)}  # val_seed: seed + size
    kept = [e for e in entries if e["question"] not in held_out]
    assert len(source.train) == len(kept) and source.train.reward_rows[0].extra_info == kept[0]
    for ids, entry in zip(source.train.prompt_ids[:5], kept):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{entry['question']} Give only the number."}],
            add_generation_prompt=True,
            tokenize=False,
        )
        assert ids.tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    val = source.eval_prompts()
    assert [row.extra_info for row in val.meta] == generate("basic_arithmetic", CONFIG, 8, seed=64)
    assert {row.data_source for row in val.meta} == {"basic_arithmetic"}


def test_no_training_problem_is_a_held_out_one(rg_args):
    """Two 1-digit terms and + only: few distinct questions, so other seeds repeat them; those are left out of training."""
    cfg = load_config(
        rg_args(
            **{
                "data.reasoning_gym.config.max_digits": 1,
                "data.reasoning_gym.config.operators": "[+]",
                "data.reasoning_gym.val_size": 32,
            }
        )
    )
    source = make_prompt_source(cfg)
    train = [row.extra_info["question"] for row in source.train.reward_rows]
    val = {row.extra_info["question"] for row in source.eval_prompts().meta}
    assert not set(train) & val
    assert 0 < len(train) < 64  # some were left out: the test has a case to check


def test_a_curriculum_trains_on_one_mix_and_holds_out_the_task_as_evaluated(rg_args):
    """data.reasoning_gym.val_config: subtractions only in training, the held-out problems with + and - (config's
    other settings), and their rewards from a verifier built with the held-out settings."""
    cfg = load_config(
        rg_args(
            **{"data.reasoning_gym.config.operators": "[-]"},
            **{"data.reasoning_gym.val_config.operators": "[+,-]"},
        )
    )
    assert cfg.data.reasoning_gym.val_config == {"operators": ["+", "-"]}  # config's other settings hold
    assert cfg.data.reasoning_gym.held_out_config == CONFIG
    source = make_prompt_source(cfg)
    held_out = generate("basic_arithmetic", CONFIG, 8, seed=64)
    val = source.eval_prompts()
    assert [row.extra_info["entry"] for row in val.meta] == [json.dumps(e) for e in held_out]
    assert any(" + " in e["question"] for e in held_out)  # the held-out mix is not the training one
    train = [row.extra_info for row in source.train.reward_rows]
    assert train == [e for e in generate("basic_arithmetic", {**CONFIG, "operators": ["-"]}, 64, seed=0)
                     if e["question"] not in {h["question"] for h in held_out}]  # fmt: skip
    assert all(" - " in e["question"] and " + " not in e["question"] for e in train)
    answers = [e["answer"] for e in held_out]
    assert scored(source, val, answers).tolist() == [1.0] * 8
    assert scored(source, val, [str(int(a) + 1) for a in answers]).tolist() == [0.0] * 8
    # the held-out rows were scored by a dataset of the held-out settings, not the training ones
    assert list(source.reward.builtin._datasets) == [json.dumps(CONFIG, sort_keys=True)]
    scored(source, source.train.prompts([0]), [train[0]["answer"]])
    assert json.dumps({**CONFIG, "operators": ["-"]}, sort_keys=True) in source.reward.builtin._datasets


def test_a_model_without_a_chat_template_gets_plain_text(rg_args, tiny_smollm, tmp_path, caplog):
    plain = tmp_path / "plain_model"
    shutil.copytree(tiny_smollm["model"], plain)
    (plain / "chat_template.jinja").unlink()
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    cfg = load_config(rg_args(**{"model.path": plain, "data.reasoning_gym.prompt_suffix": "Be brief."}))
    with caplog.at_level(logging.WARNING, logger="dppo"):
        source = make_prompt_source(cfg)
    assert "has no chat template" in caplog.text and "plain text" in caplog.text
    entry = source.train.reward_rows[0].extra_info
    assert (
        source.train.prompt_ids[0].tolist()
        == source.tokenizer(f"{entry['question']} Be brief.", add_special_tokens=False)["input_ids"]
    )


def test_the_dataset_config_is_a_mapping_in_a_yaml_file_or_keys_on_the_command_line(rg_args, tmp_path):
    on_line = load_config(rg_args())
    assert on_line.data.reasoning_gym.config == CONFIG
    yaml_file = tmp_path / "rg.yaml"
    yaml_file.write_text("data:\n  reasoning_gym:\n    config:\n      max_digits: 1\n      operators: ['+']\n")
    args = [a for a in rg_args() if not a.startswith("data.reasoning_gym.config.")]
    from_file = load_config(args, config_file=yaml_file)
    assert from_file.data.reasoning_gym.config == {"max_digits": 1, "operators": ["+"]}


@pytest.mark.parametrize("override, fragments", [
    ({"data.reasoning_gym.dataset": "basic_arithmetc"},
     ["data.reasoning_gym.dataset='basic_arithmetc'", "did you mean basic_arithmetic", "chain_sum"]),
    ({"data.reasoning_gym.config.max_digit": 2}, ["has no setting 'max_digit'", "did you mean max_digits"]),
    ({"data.reasoning_gym.config.min_digits": 0}, ["refuses the settings", "min_digits must be positive"]),
    ({"data.reasoning_gym.config.seed": 3}, ["'seed'", "data.reasoning_gym.seed"]),
    ({"data.reasoning_gym.val_config.max_digit": 2},
     ["data.reasoning_gym.val_config:", "has no setting 'max_digit'", "did you mean max_digits"]),
    ({"data.reasoning_gym.val_config.operators": "[x]"}, ["data.reasoning_gym.val_config:", "unsupported operator"]),
    ({"data.reasoning_gym.val_seed": 0}, ["val_seed=0", "overlap the training problems' 0..63"]),
    ({"data.reasoning_gym.val_seed": 40}, ["val_seed=40", "use a val_seed >= 64"]),
    ({"data.reasoning_gym.dataset": None}, ["needs data.reasoning_gym.dataset"]),
    ({"data.source": "task"}, ["data.reasoning_gym.dataset='basic_arithmetic' is for data.source=reasoning_gym"]),
    ({"custom_reward_function.path": __file__}, ["custom_reward_function.path", "data.source=reasoning_gym"]),
])  # fmt: skip
def test_a_bad_dataset_or_setting_is_one_line_exit_2_before_anything_starts(
    override, fragments, rg_args, tmp_path, capsys
):
    assert main(["train", *rg_args(**override)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dppo: error: "), err
    assert all(f in err[0] for f in fragments), err[0]
    assert not (tmp_path / "run").exists()  # nothing started: not even the output directory


def test_without_reasoning_gym_installed_it_is_one_line_naming_the_extra(rg_args, monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym raises ImportError
    cfg = load_config(rg_args())  # plain data: the dataset is built before the run starts, not by the config
    with pytest.raises(ConfigError, match=r"data.source=reasoning_gym needs the reasoning_gym package.*dppo\[tasks\]"):
        check_prompt_source(cfg.data, cfg.model, cfg.task, cfg.trainer)


def test_a_3_step_run_on_an_imported_gguf_model_logs_the_verifiers_rewards_and_the_held_out_score(
    rg_args, tiny_smollm, tmp_path, capsys, monkeypatch
):
    from dppo.trainer.rollout import InProcessRollout

    groups, fetch = [], InProcessRollout.fetch

    def recording_fetch(self, num_groups, version):
        taken, dropped = fetch(self, num_groups, version)
        groups.extend(taken)
        return taken, dropped

    monkeypatch.setattr(InProcessRollout, "fetch", recording_fetch)
    assert main(["train", *rg_args(**{"trainer.total_steps": 3})]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert 0.0 <= r["critic/score/mean"] <= 1.0 and np.isfinite(r["actor/pg_loss"])
    assert "val/score/basic_arithmetic" not in records[0]  # the held-out score joins the last step's line
    assert 0.0 <= records[-1]["val/score/basic_arithmetic"] <= 1.0
    assert 0.0 <= records[-1]["val/acc/basic_arithmetic"] <= records[-1]["val/score/basic_arithmetic"]
    assert all(0.0 <= r["reward/extra/acc"] <= r["critic/score/mean"] for r in records)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["evaluation"]["val/score/basic_arithmetic"] == records[-1]["val/score/basic_arithmetic"]
    assert "greedy val/score/basic_arithmetic" in capsys.readouterr().out

    # every training reward is the verifier's score of that response's extracted answer, for that prompt's problem
    tokenizer = AutoTokenizer.from_pretrained(tiny_smollm["model"])
    entries = {e["question"]: e for e in generate("basic_arithmetic", CONFIG, 64, seed=0)}
    import reasoning_gym  # here, not at the top: .venv-vllm (make test-vllm) collects this module without it

    verifier = reasoning_gym.create_dataset("basic_arithmetic", **CONFIG)
    assert len(groups) == 3 * 4
    for g in groups:
        prompt = tokenizer.decode(g.prompt)
        entry = entries[prompt.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]]
        texts = tokenizer.batch_decode(
            [r[m].tolist() for r, m in zip(g.responses, g.response_mask)], skip_special_tokens=True
        )
        expected = [verifier.score_answer(extract_answer(t, entry["answer"]), entry) for t in texts]
        assert g.scores.tolist() == pytest.approx(expected, abs=0)


def test_make_reals_curriculum_trains_on_more_subtractions_and_holds_out_the_even_mix(tiny_smollm):
    """examples/real/smollm2_arithmetic.yaml: two subtractions in three in training, and the 256 held-out problems of the
    even mix that every earlier `make real` figure was measured on (items of seeds 3000..3255)."""
    from pathlib import Path

    from dppo.data.reasoning_gym import split_entries

    yaml_file = Path(__file__).resolve().parents[3] / "examples" / "real" / "smollm2_arithmetic.yaml"
    cfg = load_config([f"model.path={tiny_smollm['model']}"], config_file=yaml_file)
    rg = cfg.data.reasoning_gym
    even = {**rg.config, "operators": ["+", "-"]}
    assert rg.held_out_config == even and rg.config["operators"] == ["+", "-", "-"]
    train, val = split_entries(rg, cfg.trainer.seed)
    assert val == generate("basic_arithmetic", even, 256, seed=3000)
    subtractions = sum(" - " in e["question"] for e in train) / len(train)
    assert 0.6 < subtractions < 0.72, subtractions  # 2/3 drawn; the even mix would give about 0.5
