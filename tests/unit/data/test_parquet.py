"""The parquet loader and the text source on good and bad input: every problem names the file, column or row."""

import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dppo.data import DataColumnError, DataFileError, DataRowError, PromptTooLongError, TokenizerError
from dppo.data.parquet import read_parquet_files
from dppo.data import make_prompt_source
from dppo.data.text import EpochSampler, TextSource
from dppo.config import ConfigError


def _row(content="reverse 12", source="s", truth="21", **extra):
    return {
        "prompt": [{"role": "user", "content": content}],
        "data_source": source,
        "reward_model": {"style": "rule", "ground_truth": truth},
        **extra,
    }


def _write(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_good_files_are_read_in_order_with_where_each_row_came_from(tmp_path):
    first = _write(
        tmp_path / "a.parquet",
        [_row("reverse 1", "x", "1", extra_info={"i": 0}), _row("reverse 23", "y", "32", extra_info={"i": 1})],
    )
    second = _write(tmp_path / "b.parquet", [_row("reverse 456", "x", "654")])  # no extra_info column
    rows = read_parquet_files([first, second])
    assert len(rows) == 3
    assert rows.messages[2] == [{"role": "user", "content": "reverse 456"}]
    assert rows.data_source == ["x", "y", "x"] and rows.ground_truth == ["1", "32", "654"]
    assert rows.extra_info == [{"i": 0}, {"i": 1}, None]
    assert rows.where(1) == f"row 1 of {first!r}" and rows.where(2) == f"row 0 of {second!r}"


def test_prompts_go_through_the_chat_template_with_the_generation_prompt(text_cfg, text_example):
    source = make_prompt_source(text_cfg())
    assert isinstance(source, TextSource)
    tokenizer = source.tokenizer
    assert type(tokenizer).__name__.startswith("Qwen2Tokenizer")  # AutoTokenizer picked the Qwen2 class
    rows = pq.read_table(text_example["train"]).to_pylist()
    text = tokenizer.apply_chat_template(rows[3]["prompt"], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert source.train.prompt_ids[3].tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert source.eos_token == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert source.pad_token == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert {len(ids) for ids in source.train.prompt_ids} == {12, 13, 14, 15}  # 2 to 5 digits: padding needed
    assert source.response_length == 6
    assert source.train.reward_rows[3].ground_truth == rows[3]["reward_model"]["ground_truth"]
    assert source.train.reward_rows[3].where == f"row 3 of {str(text_example['train'])!r}"


@pytest.mark.parametrize("truncation, kept", [("left", slice(-12, None)), ("right", slice(0, 12))])
def test_left_and_right_truncation_keep_the_end_or_the_start(text_cfg, truncation, kept):
    full = make_prompt_source(text_cfg()).train.prompt_ids
    cut = make_prompt_source(text_cfg(**{"data.max_prompt_length": 12, "data.truncation": truncation})).train.prompt_ids
    for whole, part in zip(full, cut):
        assert part.tolist() == whole[kept].tolist()


def test_a_too_long_prompt_with_truncation_error_names_the_row_and_its_length(text_cfg, text_example):
    with pytest.raises(PromptTooLongError) as err:
        make_prompt_source(text_cfg(**{"data.max_prompt_length": 14}))
    message = str(err.value)
    assert f"of {str(text_example['train'])!r}: its prompt is 15 tokens" in message
    assert "data.max_prompt_length=14" in message and message.startswith("row ")


@pytest.mark.parametrize("rows, error, fragments", [
    ([{"prompt": [{"role": "user", "content": "x"}], "reward_model": {"ground_truth": "1"}}], DataColumnError,
     ["no column 'data_source'", "prompt, reward_model"]),
    ([{"question": [{"role": "user", "content": "x"}], "data_source": "s", "reward_model": {"ground_truth": "1"}}],
     DataColumnError, ["no column 'prompt' (data.prompt_key)"]),
    ([{"prompt": [{"role": "user", "content": "x"}], "data_source": "s", "reward_model": {"style": "rule"}}],
     DataColumnError, ["column 'reward_model' has no field 'ground_truth'"]),
    ([{**_row(), "prompt": "just text"}], DataRowError, ["row 0 of", "str 'just text'", "list of chat messages"]),
    ([_row(), _row(), {**_row(), "prompt": [{"role": "user"}]}], DataRowError, ["row 2 of", "'role': str"]),
    ([_row(), {**_row(), "reward_model": {"style": "rule", "ground_truth": None}}], DataRowError, ["row 1 of", "ground_truth is null"]),
])  # fmt: skip
def test_bad_files_name_the_file_and_the_column_or_row(tmp_path, rows, error, fragments):
    path = _write(tmp_path / "bad.parquet", rows)
    with pytest.raises(error) as err:
        read_parquet_files(path)
    assert repr(path) in str(err.value)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_a_missing_or_unreadable_file(tmp_path):
    with pytest.raises(DataFileError, match="does not exist"):
        read_parquet_files(str(tmp_path / "none.parquet"))
    (tmp_path / "text.parquet").write_text("not parquet")
    with pytest.raises(DataFileError, match="text.parquet' is not a readable parquet file"):
        read_parquet_files(str(tmp_path / "text.parquet"))


def _model_dir_without(tmp_path, text_example, *names):
    target = tmp_path / "model"
    shutil.copytree(text_example["model"], target)
    for name in names:
        (target / name).unlink()
    return target


def test_a_model_directory_without_a_tokenizer_says_so(text_cfg, tmp_path, text_example):
    target = _model_dir_without(tmp_path, text_example, "tokenizer.json", "tokenizer_config.json")
    with pytest.raises(TokenizerError, match=f"model.path={str(target)!r} has no tokenizer"):
        make_prompt_source(text_cfg(**{"model.path": target}))


def test_a_tokenizer_without_a_chat_template_says_so(text_cfg, tmp_path, text_example):
    target = _model_dir_without(tmp_path, text_example, "chat_template.jinja")
    with pytest.raises(TokenizerError, match="has no chat template"):
        make_prompt_source(text_cfg(**{"model.path": target}))


@pytest.mark.parametrize("overrides, fragments", [
    ({"model.path": None}, ["data.train_files=", "needs model.path"]),
    ({"data.truncation": "middle"}, ["data.truncation", "middle", "'left'"]),
    ({"data.max_prompt_length": 0}, ["data.max_prompt_length=0"]),
    ({"data.train_files": None}, ["data.val_files=", "data.train_files is null"]),
])  # fmt: skip
def test_config_errors_name_the_key(text_cfg, overrides, fragments):
    with pytest.raises(ConfigError) as err:
        text_cfg(**overrides)
    for fragment in fragments:
        assert fragment in str(err.value)


@pytest.mark.parametrize("overrides, line", [
    ({"data.train_files": "/no/such.parquet"}, "data.train_files='/no/such.parquet': data file '/no/such.parquet' does not exist"),
    ({"data.val_files": "[/no/val.parquet]"}, "data.val_files=['/no/val.parquet']: data file '/no/val.parquet' does not exist"),
    ({"custom_reward_function.path": "/no/reward.py"}, "custom_reward_function.path='/no/reward.py': the reward function's file does not exist"),
])  # fmt: skip
def test_a_missing_data_or_reward_file_is_a_data_error(text_cfg, overrides, line):
    """Exit code 6 (DataError), as an unreadable file is; not a config error. The config names the files; the machine
    check before a run (dppo.launch.machine) finds them missing."""
    from dppo.launch.machine import check_machine

    cfg = text_cfg(**overrides)  # plain data: building it looks at no file
    with pytest.raises(DataFileError) as err:
        check_machine(cfg)
    assert str(err.value) == line


def test_bad_data_stops_dppo_train_with_one_line_before_ray_starts(text_args, tmp_path, monkeypatch, capsys):
    import ray

    from dppo.cli import main

    monkeypatch.setattr(ray, "init", lambda **kwargs: pytest.fail("Ray started before the data was checked"))
    bad = _write(
        tmp_path / "bad.parquet",
        [{"prompt": [{"role": "user", "content": "x"}], "reward_model": {"ground_truth": "1"}}],
    )
    args = text_args(**{"data.train_files": bad, "ray.enabled": True, "trainer.mode": "separate_async"})
    assert main(["train", *args]) == 6
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"dppo: error: data file {bad!r} has no column 'data_source'")


def test_epochs_cover_every_row_once_per_epoch_across_workers():
    seen = [EpochSampler(10, True, seed=3, worker_index=w, num_workers=3).next_rows(8) for w in range(3)]
    first_epoch = np.concatenate([s[: len(range(w, 10, 3))] for w, s in enumerate(seen)])
    assert sorted(first_epoch.tolist()) == list(range(10))
    again = EpochSampler(10, True, seed=3, worker_index=1, num_workers=3)
    assert again.next_rows(8).tolist() == seen[1].tolist()  # reproducible
    resumed = EpochSampler(10, True, seed=3, worker_index=1, num_workers=3, start=5)
    assert resumed.next_rows(3).tolist() == seen[1][5:8].tolist()
    ordered = EpochSampler(4, False, seed=0).next_rows(10)
    assert ordered.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
