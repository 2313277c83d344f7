"""Prompts, scorers and evaluation sets: integer tasks (the demo) and verl-format parquet text data.

See dppo.data.source for the interface the trainer and the rollout workers use.
"""

from dppo.data.errors import (
    DataColumnError,
    DataError,
    DataFileError,
    DataRowError,
    MissingExtraError,
    PromptTooLongError,
    RewardFunctionError,
    TokenizerError,
)
from dppo.data.rewards import RewardFunction, gsm8k_compute_score
from dppo.data.source import Prompts, PromptSource, Scores, TaskSource
from dppo.data.text import TextSource

__all__ = [
    "DataColumnError",
    "DataError",
    "DataFileError",
    "DataRowError",
    "MissingExtraError",
    "PromptSource",
    "PromptTooLongError",
    "Prompts",
    "RewardFunction",
    "RewardFunctionError",
    "Scores",
    "TaskSource",
    "TextSource",
    "TokenizerError",
    "gsm8k_compute_score",
    "make_prompt_source",
]


def make_prompt_source(cfg) -> PromptSource:
    """TextSource when data.train_files is set (reads and checks every file now), else the task's TaskSource."""
    if cfg.data.train_files is not None:
        return TextSource.from_config(cfg)
    return TaskSource.from_config(cfg)
