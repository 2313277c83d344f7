"""Reward functions: the GSM8K default, verl's signature and return kinds, extras, and every way one can fail."""

import pickle

import numpy as np
import pytest

from dppo.data import DataFileError, RewardFunction, RewardFunctionError, gsm8k_compute_score
from dppo.data.rewards import RewardRow, score_texts


@pytest.mark.parametrize("response, truth, expected", [
    ("so she has 18 apples. #### 18", "Natalia sold 48/2 = 24 clips.\n#### 18", 1.0),
    ("The answer is 1,000.", "#### 1000", 1.0),
    ("first 3, then 72.0", "#### 72", 1.0),
    ("-5 is it", "#### -5", 1.0),
    ("18 apples, 19 pears", "#### 18", 0.0),  # the last number counts
    ("no number here", "#### 18", 0.0),
    ("42", "42", 1.0),  # a bare ground truth is the answer
])  # fmt: skip
def test_gsm8k_default_compares_the_last_number_with_the_answer_after_hashes(response, truth, expected):
    assert gsm8k_compute_score("openai/gsm8k", response, truth) == expected
    assert RewardFunction()("openai/gsm8k", response, truth, None, "row 0") == (expected, {})


def _reward_file(tmp_path, body, name="my_reward.py"):
    path = tmp_path / name
    path.write_text(body)
    return str(path)


def test_a_custom_function_gets_verls_keyword_arguments_and_its_extras_are_kept(tmp_path):
    path = _reward_file(
        tmp_path,
        (
            "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
            "    extra = {'length': len(solution_str), 'tag': 'text is not logged'}\n"
            "    if extra_info['index'] == 1:\n"
            "        extra['hit'] = True\n"
            "    return {'score': float(solution_str == ground_truth), **extra}\n"
        ),
    )
    fn = RewardFunction(path, "compute_score")
    rows = [RewardRow("s", "ab", {"index": i}, f"row {i}") for i in range(3)]
    scores, extras = score_texts(fn, rows, ["ab", "abc", "x"])
    assert scores.dtype == np.float32 and scores.tolist() == [1.0, 0.0, 0.0]
    assert extras["length"].tolist() == [2.0, 3.0, 1.0] and "tag" not in extras
    assert np.isnan(extras["hit"][[0, 2]]).all() and extras["hit"][1] == 1.0  # NaN where a row's dict lacked it
    copy = pickle.loads(pickle.dumps(fn))  # goes to the workers as the file's text, compiled there
    assert copy("s", "ab", "ab", {"index": 0}, "row 0")[0] == 1.0


@pytest.mark.parametrize("body, fragments", [
    ("    raise ValueError('no\\nanswer')\n", ["raised ValueError: no answer"]),
    ("    return float('nan')\n", ["non-finite score nan"]),
    ("    return {'score': float('inf')}\n", ["non-finite score inf"]),
    ("    return 'high'\n", ["returned str 'high'", "a dict with 'score'"]),
    ("    return {'value': 1.0}\n", ["dict without 'score' (keys: value)"]),
    ("    return None\n", ["returned NoneType"]),
])  # fmt: skip
def test_a_reward_that_raises_or_returns_no_finite_score_is_one_line_naming_function_source_and_row(
    tmp_path, body, fragments
):
    path = _reward_file(tmp_path, "def judge(data_source, solution_str, ground_truth, extra_info=None):\n" + body)
    fn = RewardFunction(path, "judge")
    rows = [RewardRow("gsm8k", "1", None, "row 0 of 'a.parquet'"), RewardRow("math", "2", None, "row 7 of 'a.parquet'")]
    with pytest.raises(RewardFunctionError) as err:
        score_texts(fn, rows, ["1", "2"])
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"reward function 'judge' in {path!r} ")
    assert message.endswith("(data_source='gsm8k', row 0 of 'a.parquet')")
    for fragment in fragments:
        assert fragment in message


def test_a_bad_reward_file_fails_when_it_is_loaded(tmp_path):
    with pytest.raises(DataFileError, match="cannot read it"):
        RewardFunction(str(tmp_path / "none.py"))
    path = _reward_file(
        tmp_path, "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
    )
    with pytest.raises(
        RewardFunctionError, match="defines no function custom_reward_function.name='compute_score'; it defines: score"
    ):
        RewardFunction(path)
    broken = _reward_file(tmp_path, "def compute_score(:\n", name="broken.py")
    with pytest.raises(RewardFunctionError, match="broken.py' failed to load: SyntaxError"):
        RewardFunction(broken)


def test_a_failing_reward_stops_dppo_train_with_one_line(text_args, tmp_path, capsys):
    from dppo.cli import main

    path = _reward_file(
        tmp_path,
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    raise KeyError('grader offline')\n",
    )
    assert main(["train", *text_args(**{"custom_reward_function.path": path})]) == 6
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(
        f"dppo: error: reward function 'compute_score' in {path!r} raised KeyError: 'grader offline' "
        "(data_source='reverse_"
    )
    assert ".parquet')" in err[0] and ", row " in err[0]
