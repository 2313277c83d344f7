"""`dppo data reasoning-gym NAME OUT.parquet [--size N] [--seed S] [--config KEY=VALUE ...] [--prompt-suffix TEXT]`:
a reasoning-gym dataset's problems as verl-format parquet, for any trainer that reads verl's format (verl itself,
or dppo with data.train_files and custom_reward_function.path=examples/reasoning_gym_reward.py).

    write_reasoning_gym_parquet(name, out, size, seed, config, prompt_suffix, split, force) -> rows written

One row per problem (items 0..size-1 at seed, as data.source=reasoning_gym generates them):

    data_source    the dataset's name
    prompt         [{"role": "user", "content": question (+ " " + prompt_suffix)}]
    ability        the dataset's category in reasoning-gym (arithmetic, algebra, games, ...)
    reward_model   {"style": "rule", "ground_truth": the answer}
    extra_info     {"split", "index", "dataset", "seed", "config": the dataset config as JSON,
                    "entry": the whole entry (question, answer, metadata) as JSON, what score_answer reads}

The file is written beside OUT and renamed into place; an existing OUT is replaced only with --force.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from dppo.commands.output import check_output, staged_output
from dppo.config import ConfigError
from dppo.data.reasoning_gym import DatasetConfigError, UnknownDatasetError, make_dataset, prompt_text


def parse_config_items(items: list[str]) -> dict:
    """["min_terms=2", "operators=[+,-]"] -> {"min_terms": 2, "operators": ["+", "-"]}: each value read as YAML
    (numbers, booleans, lists), as data.reasoning_gym.config.KEY=VALUE is; ConfigError on an item without '='."""
    config = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--config {item!r}: expected KEY=VALUE (e.g. --config max_digits=2)")
        try:
            config[key] = yaml.safe_load(value)
        except yaml.YAMLError:
            config[key] = value
    return config


def _dataset(name: str, config: dict, size: int, seed: int):
    """reasoning-gym's dataset; a ConfigError (exit code 2) naming an unknown dataset or a bad setting."""
    if size <= 0:
        raise ConfigError(f"--size={size}: expected a number of problems > 0")
    try:
        return make_dataset(name, config, size, seed)
    except UnknownDatasetError as err:
        raise ConfigError(f"NAME {name!r}: {err}") from None
    except DatasetConfigError as err:
        raise ConfigError(f"--config: {err}") from None


def reasoning_gym_rows(
    name: str, size: int, seed: int, config: dict, prompt_suffix: str = "", split: str = "train"
) -> list[dict]:
    """The verl-format rows of items 0..size-1 of dataset name at seed (see the module docstring)."""
    dataset = _dataset(name, config, size, seed)
    config_json = json.dumps(config, sort_keys=True)
    rows = []
    for index in range(size):
        entry = dataset[index]
        rows.append({
            "data_source": name,
            "prompt": [{"role": "user", "content": prompt_text(entry["question"], prompt_suffix)}],
            "ability": dataset.category,
            "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
            "extra_info": {"split": split, "index": index, "dataset": name, "seed": seed, "config": config_json,
                           "entry": json.dumps(entry, default=str)},
        })  # fmt: skip
    return rows


def write_reasoning_gym_parquet(
    name: str,
    out: str | os.PathLike,
    size: int = 1000,
    seed: int = 0,
    config: dict | None = None,
    prompt_suffix: str = "",
    split: str = "train",
    force: bool = False,
) -> int:
    """The rows of reasoning_gym_rows as a parquet file at out; the number of rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    _dataset(name, dict(config or {}), size, seed)  # a bad name or setting is named before the output is looked at
    out = check_output(out, force, directory=False)
    rows = reasoning_gym_rows(name, size, seed, dict(config or {}), prompt_suffix, split)
    with staged_output(Path(out), directory=False) as staging:
        pq.write_table(pa.Table.from_pylist(rows), staging)
    return len(rows)
