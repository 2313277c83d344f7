"""Errors of bad data, tokenizers and reward functions: one base class the command line prints as one line.

Each also derives from the matching builtin and names the file, row, column or function at fault.
"""

from __future__ import annotations


class DataError(Exception):
    """Base class: the data, its tokenizer or its reward function cannot be used (`dppo: error: ...`, exit 1)."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0]) if self.args else ""


class DataFileError(DataError, FileNotFoundError):
    """A data file does not exist or is not a readable parquet file."""


class DataColumnError(DataError, KeyError):
    """A data file lacks a column (or a field of a struct column) the loader needs."""


class DataRowError(DataError, ValueError):
    """A row holds a value of the wrong kind (e.g. a prompt that is not a list of chat messages)."""


class PromptTooLongError(DataError, ValueError):
    """A prompt is longer than data.max_prompt_length tokens and data.truncation is 'error'."""


class TokenizerError(DataError, ValueError):
    """model.path holds no usable tokenizer: none at all, no chat template, or no EOS token."""


class RewardFunctionError(DataError, RuntimeError):
    """The reward function raised, or returned something other than a finite score."""
