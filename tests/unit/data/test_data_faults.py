"""Damaged data files are one line naming the file and the row group; ground truths of any scalar type reach the
reward function as they are stored."""

import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dppo.data import DataError, DataFileError, RewardFunction, gsm8k_compute_score
from dppo.data.parquet import read_parquet_files

ROWS, GROUP_ROWS = 300, 50


def write_rows(path, truths, row_group_size=GROUP_ROWS) -> str:
    rows = [
        {
            "prompt": [{"role": "user", "content": f"reverse {i} " + "x" * (i % 40)}],
            "data_source": "s",
            "reward_model": {"style": "rule", "ground_truth": truth},
        }
        for i, truth in enumerate(truths)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return str(path)


def damaged(path, good: bytes, start: int, length: int, seed: int) -> str:
    """good with `length` random bytes from `start` on: the magic bytes at both ends intact."""
    rng = random.Random(seed)
    data = bytearray(good)
    data[start : start + length] = bytes(rng.randrange(256) for _ in range(length))
    path.write_bytes(bytes(data))
    return str(path)


def test_a_corrupt_page_names_the_file_its_row_group_and_its_rows(tmp_path):
    good = write_rows(tmp_path / "good.parquet", [str(i) for i in range(ROWS)])
    metadata = pq.ParquetFile(good).metadata
    group = 3  # overwrite the middle of row group 3's first column chunk (its page header and data)
    chunk = metadata.row_group(group).column(0)
    start = chunk.data_page_offset
    path = damaged(tmp_path / "bad.parquet", open(good, "rb").read(), start, 32, seed=0)
    with pytest.raises(DataFileError) as err:
        read_parquet_files(path)
    message = str(err.value)
    assert message.startswith(f"data file {path!r}: row group 3 of 6 (rows 150 to 199) cannot be read (")
    assert message.endswith("); the file is damaged: write it again") and "\n" not in message


def test_random_damage_anywhere_is_a_data_error_or_a_read_never_another_exception(tmp_path):
    good = open(write_rows(tmp_path / "good.parquet", [str(i) for i in range(ROWS)]), "rb").read()
    kinds = set()
    for seed in range(40):
        start = random.Random(seed).randrange(4, len(good) - 68)
        try:
            read_parquet_files(damaged(tmp_path / "bad.parquet", good, start, 64, seed))
            kinds.add("read")
        except DataError as err:  # anything else fails the test with its traceback
            kinds.add(type(err).__name__)
    assert "DataFileError" in kinds


def test_a_corrupt_page_stops_dppo_train_with_one_line_and_exit_code_6(text_args, tmp_path, text_example, capsys):
    from dppo.cli import main

    good = open(text_example["train"], "rb").read()
    chunk = pq.ParquetFile(text_example["train"]).metadata.row_group(0).column(0)
    path = damaged(tmp_path / "train.parquet", good, chunk.data_page_offset, 32, seed=1)
    assert main(["train", *text_args(**{"data.train_files": path})]) == 6
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"dppo: error: data file {path!r}: row group 0 of "), err


@pytest.mark.parametrize(
    "truths",
    [[7, 42, 1000], [7.0, 42.5, 1e3], [True, False, True], ["7", "42", "1,000"]],
    ids=["int", "float", "bool", "str"],
)
def test_ground_truth_of_any_scalar_type_reaches_a_custom_reward_as_stored(tmp_path, truths):
    path = write_rows(tmp_path / "typed.parquet", truths)
    stored = read_parquet_files(path).ground_truth
    assert stored == truths and [type(t) for t in stored] == [type(t) for t in truths]
    reward = tmp_path / "typed_reward.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': 1.0, 'seen': ground_truth}\n"
    )
    fn = RewardFunction(str(reward))
    seen = [fn.function()("s", "x", truth) for truth in stored]
    assert [s["seen"] for s in seen] == truths and [type(s["seen"]) for s in seen] == [type(t) for t in truths]


@pytest.mark.parametrize(
    "truth, response, score",
    [
        (42, "it is 42", 1.0),
        (42, "it is 41", 0.0),
        (42.0, "42", 1.0),
        (1000, "1,000", 1.0),
        (True, "True", 0.0),
        (7, "no number", 0.0),
    ],
)
def test_the_built_in_reward_compares_a_ground_truth_of_any_type_as_its_string(truth, response, score):
    assert gsm8k_compute_score("s", response, truth) == score
    assert RewardFunction()("s", response, truth, None, "row 0") == (score, {})
