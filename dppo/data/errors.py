"""Errors of bad data, tokenizers and reward functions: one base class the command line prints as one line.

Each also derives from the matching builtin and names the file, row, column or function at fault. And the error
of an optional package that is not installed (MissingExtraError), which names the extra that brings it.
"""

from __future__ import annotations

import importlib
import sys


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


class AgentFunctionError(DataError, RuntimeError):
    """rollout.agent.path cannot be used: the file does not load or does not define rollout.agent.name."""


class MissingExtraError(ImportError):
    """An optional package that a data source or a command needs is not installed; the message names dppo's extra
    that brings it (`pip install 'dppo[tasks]'`). Not a DataError: the command line reports it as an invalid
    setting (exit code 2), as it does a tracker or vLLM that is not installed."""


def require_extra(module: str, extra: str, needed_by: str):
    """The imported module, or MissingExtraError naming needed_by, the module and the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingExtraError(
            f"{needed_by} needs the {module} package, which is not importable in this Python "
            f"({sys.prefix}: {err}); install the extra: pip install 'dppo[{extra}]'"
        ) from None
