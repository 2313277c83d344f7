"""Prompts, scorers and evaluation sets: integer tasks (the demo) and verl-format parquet text data.

See dppo.data.source for the interface the trainer and the rollout workers use.
"""

from dppo.data.errors import (
    DataColumnError,
    DataError,
    DataFileError,
    DataRowError,
    PromptTooLongError,
    RewardFunctionError,
    TokenizerError,
)
from dppo.data.rewards import RewardFunction, gsm8k_compute_score
from dppo.data.source import Prompts, PromptSource, Scores, TaskSource, make_prompt_source

__all__ = [
    "DataColumnError",
    "DataError",
    "DataFileError",
    "DataRowError",
    "PromptSource",
    "PromptTooLongError",
    "Prompts",
    "RewardFunction",
    "RewardFunctionError",
    "Scores",
    "TaskSource",
    "TokenizerError",
    "gsm8k_compute_score",
    "make_prompt_source",
]
