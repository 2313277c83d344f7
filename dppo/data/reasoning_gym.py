"""reasoning-gym's procedural datasets as a prompt source (data.source=reasoning_gym): problems generated from seeds,
offline, each rewarded by its dataset's own verifier (score_answer).

    ReasoningGymSource.from_config(...)           a TextSource over generated problems (sampling, decoding, eval)
    dataset_config_class(name, config)             the dataset's config class; UnknownDatasetError, DatasetConfigError
    generate(name, config, size, seed)             the entries (question, answer, metadata) of items 0..size-1
    split_entries(rg, run_seed)                    the training and held-out entries of a data.reasoning_gym section
    extract_answer(response, expected) -> str      the answer handed to score_answer
    ReasoningGymScore(name, config)                verl's reward signature over the dataset's score_answer

The reasoning-gym package comes with the extra dppo[tasks]; it is imported only where this source is used (a
MissingExtraError naming the extra otherwise).

Problems. reasoning-gym draws item i of a dataset from a generator seeded with seed + i (nearly every dataset does),
so the training problems are items 0..size-1 of data.reasoning_gym.seed and the held-out ones items 0..val_size-1
of val_seed (null: seed + size, the next seeds): the config refuses seed ranges that overlap, and a training problem
whose question is also a held-out one's is left out (a small problem space repeats questions under other seeds).
The held-out problems take data.reasoning_gym.val_config's settings over config's where it is set (a curriculum:
training on another mix of the task than the one evaluated). All are generated and tokenized once, on the
driver, before anything starts.

Prompts. The question, then a space and data.reasoning_gym.prompt_suffix when one is set, as one user message
through the chat template of model.path's tokenizer (with the generation prompt). A tokenizer without a chat
template gets that text as it is (plain text), with a warning line saying so.

Reward. The dataset's score_answer(answer, entry) on the answer taken from the decoded response (special tokens
left out), the first of these that applies:
1. the text inside the last <answer>...</answer> (reasoning-gym's own format: its system prompts and its
   evaluation ask for these tags);
2. where the expected answer is a number, the last number in the response (GSM8K's rule; an instruct model that
   answers briefly writes "12 + 7 = 19" or "The answer is 19."), its thousands commas dropped when the expected
   answer has none;
3. the text after the last "answer:" or "answer is" (any case) up to the end of its line, a trailing period dropped;
4. the whole response, stripped.
The verifier's score is the reward as it is: some give partial credit (basic_arithmetic: len(expected) / len(answer)
where the answer contains the expected one but is longer). Whether it is full marks comes with it as the extra "acc"
(reward/extra/acc in training, val/acc/<dataset> in the evaluation): the exact accuracy.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import re

from dppo.data.errors import require_extra
from dppo.data.parquet import ParquetRows
from dppo.data.rewards import RewardFunction, last_number
from dppo.data.text import TextRows, TextSource, has_chat_template, load_tokenizer, tokenize_rows

log = logging.getLogger("dppo.data")

EXTRA = "tasks"
RESERVED_KEYS = ("seed", "size")  # set by data.reasoning_gym.seed / size / val_seed / val_size, not in its config

_ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
_ANSWER_MARKER = re.compile(r"\banswer(?:\s*:|\s+is\s*:?)[ \t]*(.*)", re.IGNORECASE)  # to the end of its line
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")


class UnknownDatasetError(KeyError):
    """data.reasoning_gym.dataset names no dataset reasoning-gym has registered."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0])


class DatasetConfigError(ValueError):
    """data.reasoning_gym.config holds a key the dataset's config does not have, or a value it refuses."""


def reasoning_gym(needed_by: str = "data.source=reasoning_gym"):
    """The reasoning_gym package, or MissingExtraError naming the extra dppo[tasks]."""
    return require_extra("reasoning_gym", EXTRA, needed_by)


def dataset_names() -> list[str]:
    """Every dataset reasoning-gym has registered, sorted."""
    reasoning_gym()  # importing the package registers its datasets
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def _close(name: str, names: list[str]) -> str:
    close = difflib.get_close_matches(name, names, n=5, cutoff=0.6)
    return f"did you mean {', '.join(close)}? " if close else ""


def dataset_config_class(name: str, config: dict) -> type:
    """The config dataclass of dataset name; UnknownDatasetError naming close and all names if there is none,
    DatasetConfigError naming the keys of config that it lacks (or that dppo sets itself) and the valid ones."""
    names = dataset_names()
    if name not in names:
        raise UnknownDatasetError(
            f"reasoning-gym has no dataset {name!r}; {_close(str(name), names)}its "
            f"{len(names)} datasets: {', '.join(names)}"
        )
    from reasoning_gym.factory import DATASETS

    config_class = DATASETS[name][1]
    fields = [f.name for f in dataclasses.fields(config_class) if f.name not in RESERVED_KEYS]
    for key in config:
        if key in RESERVED_KEYS:
            raise DatasetConfigError(
                f"the setting {key!r} of dataset {name!r} is dppo's own: data.reasoning_gym."
                f"{key} and val_{key} (dppo data: --{key}) give the training and held-out "
                "problems theirs"
            )
        if key not in fields:
            raise DatasetConfigError(
                f"dataset {name!r} has no setting {key!r}; {_close(str(key), fields)}its settings: {', '.join(fields)}"
            )
    return config_class


def make_dataset(name: str, config: dict, size: int, seed: int):
    """reasoning_gym.create_dataset(name, **config, size=size, seed=seed), its config checked first; a value the
    dataset refuses is a DatasetConfigError naming the dataset and the config."""
    rg = reasoning_gym()
    dataset_config_class(name, config)
    try:
        return rg.create_dataset(name, **config, size=size, seed=seed)
    except (AssertionError, ValueError, TypeError) as err:  # its config's validate() asserts
        raise DatasetConfigError(
            f"dataset {name!r} refuses the settings {json.dumps(config)}: {type(err).__name__}: {err}"
        ) from None


def generate(name: str, config: dict, size: int, seed: int) -> list[dict]:
    """The entries {question, answer, metadata} of items 0..size-1 of dataset name at seed."""
    dataset = make_dataset(name, config, size, seed)
    return [dataset[i] for i in range(size)]


def extract_answer(response: str, expected: str) -> str:
    """The answer of response that score_answer is given (the module docstring's rules 1 to 4)."""
    tagged = _ANSWER_TAG.findall(response)
    if tagged:
        return tagged[-1].strip()
    expected = str(expected).strip()
    if _PLAIN_NUMBER.fullmatch(expected):
        number = last_number(response)
        if number is not None:
            return number if "," in expected else number.replace(",", "")
    markers = _ANSWER_MARKER.findall(response)
    if markers:
        return markers[-1].strip().removesuffix(".").strip()
    return response.strip()


class ReasoningGymScore:
    """A reward function with verl's signature whose score is dataset name's score_answer on the extracted answer.

    extra_info is the dataset's entry (as ReasoningGymSource stores it), or a dict whose "entry" holds it as JSON
    (as `dppo data reasoning-gym` writes parquet rows) and whose "config", where present, holds as JSON the settings
    that entry was generated with, in place of config (held-out rows under data.reasoning_gym.val_config). Picklable:
    a dataset is built again where a config is first used (it may matter to score_answer; its seed and size do
    not)."""

    def __init__(self, name: str, config: dict):
        self.name, self.config = name, dict(config)
        self._config_json = json.dumps(self.config, sort_keys=True)  # the rows without a config of their own
        self._datasets: dict[str, object] = {}  # by the config's JSON

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_datasets": {}}

    def _dataset(self, config_json: str):
        if config_json not in self._datasets:
            self._datasets[config_json] = make_dataset(self.name, json.loads(config_json), size=1, seed=0)
        return self._datasets[config_json]

    def __call__(self, data_source: str, solution_str: str, ground_truth, extra_info=None) -> dict[str, float]:
        """{"score": the verifier's score, "acc": 1.0 where that is full marks, else 0.0}: acc is the exact accuracy
        that partial credit hides (basic_arithmetic scores "-7" for 7 as 0.5), logged as reward/extra/acc in training
        and val/acc/<dataset> in the evaluation (verl's name for it)."""
        entry, config_json = extra_info, self._config_json
        if isinstance(extra_info, dict) and isinstance(extra_info.get("entry"), str):
            entry, config_json = json.loads(extra_info["entry"]), extra_info.get("config") or self._config_json
        dataset = self._dataset(config_json)
        score = float(dataset.score_answer(extract_answer(solution_str, ground_truth), entry=entry))
        return {"score": score, "acc": float(score == 1.0)}


def prompt_text(question: str, suffix: str) -> str:
    """The user message: the question, then a space and the suffix when there is one."""
    return f"{question.rstrip()} {suffix}" if suffix else question


def _rows(name: str, entries: list[dict], seed: int, suffix: str, config: dict | None = None) -> ParquetRows:
    """entries as rows for tokenize_rows: one user message each, the answer as ground truth, the entry as extra_info
    (with config given: {"entry": its JSON, "config": config's JSON}, for ReasoningGymScore); messages name a row
    as "row 17 of 'reasoning_gym:basic_arithmetic:seed=0'"."""
    rows = ParquetRows(files=[f"reasoning_gym:{name}:seed={seed}"], file_rows=[len(entries)])
    for entry in entries:
        rows.messages.append([{"role": "user", "content": prompt_text(entry["question"], suffix)}])
        rows.data_source.append(name)
        rows.ground_truth.append(entry["answer"])
        rows.extra_info.append(
            entry if config is None else {"entry": json.dumps(entry), "config": json.dumps(config, sort_keys=True)}
        )
    return rows


def split_entries(rg, run_seed: int) -> tuple[list[dict], list[dict]]:
    """(training entries, held-out entries) of the data.reasoning_gym section rg: items 0..size-1 at its seed without
    the problems whose question is also a held-out one, and items 0..val_size-1 at val_seed (run_seed: trainer.seed,
    where rg.seed is null). What the source trains and evaluates on; peers' benchmarks read the same problems."""
    seed, val_seed = rg.resolved_seeds(run_seed)
    val_entries = generate(rg.dataset, rg.held_out_config, rg.val_size, val_seed) if rg.val_size else []
    held_out = {entry["question"] for entry in val_entries}
    train_entries = [e for e in generate(rg.dataset, rg.config, rg.size, seed) if e["question"] not in held_out]
    if not train_entries:
        raise DatasetConfigError(
            f"every one of the data.reasoning_gym.size={rg.size} training problems of "
            f"{rg.dataset!r} is also a held-out one; raise size or lower val_size"
        )
    return train_entries, val_entries


class ReasoningGymSource(TextSource):
    """A TextSource whose rows are reasoning-gym problems and whose reward is their dataset's verifier: the same
    sampling (every problem once per epoch, shuffled by data.shuffle / data.seed), decoding and evaluation
    (val/score/<dataset> on the held-out problems)."""

    @classmethod
    def from_config(cls, data, model_path: str, reward_cfg, run_seed: int, batch_size: int) -> ReasoningGymSource:
        """As TextSource.from_config: data (its reasoning_gym section), model_path, reward_cfg (only its timeout_s),
        trainer.seed (the problems' seeds when data.reasoning_gym.seed is null) and trainer.train_batch_size."""
        rg = data.reasoning_gym
        seed, val_seed = rg.resolved_seeds(run_seed)
        tokenizer = load_tokenizer(model_path, chat_template=False)
        chat = has_chat_template(tokenizer)
        if not chat:
            log.warning(
                f"the tokenizer of model.path={model_path!r} has no chat template: reasoning-gym prompts "
                "go to the model as plain text (the question and data.reasoning_gym.prompt_suffix)"
            )
        train_entries, val_entries = split_entries(rg, run_seed)

        def tokenized(entries: list[dict], at_seed: int, config: dict | None = None) -> TextRows:
            return tokenize_rows(
                tokenizer,
                _rows(rg.dataset, entries, at_seed, rg.prompt_suffix, config),
                data.max_prompt_length,
                data.truncation,
                chat_template=chat,
            )

        reward = RewardFunction(
            None,
            timeout_s=reward_cfg.timeout_s,
            builtin=ReasoningGymScore(rg.dataset, rg.config),
            builtin_label=f"reasoning-gym {rg.dataset!r}'s score_answer",
        )
        train = tokenized(train_entries, seed)
        held_out_config = None if rg.val_config is None else rg.held_out_config
        val = tokenized(val_entries, val_seed, held_out_config) if val_entries else None
        return cls._from_rows(data, model_path, tokenizer, train, val, reward, run_seed, batch_size)
