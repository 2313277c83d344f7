"""Reward functions with verl's signature, run on the rollout workers (and on the trainer for evaluation).

    compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | {"score": float, ...}

The function is called with keyword arguments, once per response. A dict's other numeric entries are
averaged and logged as reward/extra/<key>. An exception, a non-finite score or a value of another kind
stops the run with a RewardFunctionError naming the function, the data_source and the row: a reward that
silently became 0 would train the policy on noise. So does a call that takes longer than
custom_reward_function.timeout_s (dppo.data.time_limit), rather than hang the run.

custom_reward_function.path names a Python file; it is read once on the driver and executed again in each
process that scores (so the workers need neither the file nor its module on their path).
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from dppo._text import one_line
from dppo.data.errors import RewardFunctionError
from dppo.data.time_limit import CallTimeout, call_with_time_limit
from dppo.data.user_code import FileFunction

ScoreFn = Callable[..., object]

_NUMBER = re.compile(r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")


def _as_number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").replace("$", "").strip().rstrip("."))
    except ValueError:
        return None


def last_number(text: str) -> str | None:
    """The last number written in text (commas and a leading minus allowed), or None."""
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def gsm8k_compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info=None) -> float:
    """The built-in default: 1.0 if the last number of the response equals the answer, else 0.0.

    The answer is what follows '####' in ground_truth (GSM8K's format), or all of ground_truth if it has
    none; numbers compare by value ("1,000" == "1000" == "1000.0"), anything else as stripped text.
    """
    answer = str(ground_truth).split("####")[-1].strip()
    response = last_number(solution_str)
    if response is None:
        return 0.0
    expected = _as_number(answer)
    if expected is None:
        return float(response.replace(",", "") == answer)
    got = _as_number(response)
    return float(got is not None and got == expected)


class RewardFunction:
    """compute_score from custom_reward_function.path (the built-in gsm8k_compute_score when path is None, or the
    builtin given: a data source's own scorer with the same signature, e.g. a reasoning-gym dataset's).

    Picklable: a file's function travels as the file's text (dppo.data.user_code.FileFunction), compiled where it is
    first called.
    """

    def __init__(
        self,
        path: str | None = None,
        name: str = "compute_score",
        timeout_s: float | None = 60.0,
        builtin: ScoreFn = gsm8k_compute_score,
        builtin_label: str = "the built-in gsm8k reward",
    ):
        """timeout_s: how long one call may take (None: no limit); past it the run stops, as if it had raised.
        builtin (a picklable callable) and builtin_label: the function used when path is None, and how messages
        name it."""
        self.path, self.name, self.timeout_s = path, name, timeout_s
        self.builtin, self.builtin_label = builtin, builtin_label
        # read and compiled now: a broken file or a missing name fails before any worker starts
        self._file = None if path is None else FileFunction(path, name, "custom_reward_function", RewardFunctionError)

    @property
    def label(self) -> str:
        """How messages name the function: 'compute_score' in 'my_reward.py', or the built-in default."""
        return self.builtin_label if self._file is None else self._file.label

    def function(self) -> ScoreFn:
        return self.builtin if self._file is None else self._file.function()

    def __call__(self, data_source: str, solution_str: str, ground_truth, extra_info, where: str) -> tuple[float, dict]:
        """(score, numeric extras) of one response; where names the row for the error message."""
        context = f"(data_source={data_source!r}, {where})"
        try:
            result = call_with_time_limit(
                self.function(),
                self.timeout_s,
                data_source=data_source,
                solution_str=solution_str,
                ground_truth=ground_truth,
                extra_info=extra_info,
            )
        except RewardFunctionError:
            raise
        except CallTimeout:
            raise RewardFunctionError(
                f"reward function {self.label} did not return within {self.timeout_s:g} s "
                f"(custom_reward_function.timeout_s) {context}"
            ) from None
        except Exception as err:
            raise RewardFunctionError(
                f"reward function {self.label} raised {type(err).__name__}: {one_line(err, None)} {context}"
            ) from err
        extras = {}
        if isinstance(result, dict):
            if "score" not in result:
                raise RewardFunctionError(
                    f"reward function {self.label} returned a dict without 'score' "
                    f"(keys: {', '.join(map(str, result))}) {context}"
                )
            extras = {k: float(v) for k, v in result.items() if k != "score" and _is_real(v)}
            result = result["score"]
        if not _is_real(result):
            raise RewardFunctionError(
                f"reward function {self.label} returned {type(result).__name__} "
                f"{one_line(repr(result), None)[:80]}; expected a float or a dict with 'score' {context}"
            )
        score = float(result)
        if not math.isfinite(score):
            raise RewardFunctionError(f"reward function {self.label} returned the non-finite score {score} {context}")
        return score, extras


def _is_real(value: object) -> bool:
    return isinstance(value, (numbers.Real, np.bool_)) and not isinstance(value, complex)


@dataclass(frozen=True)
class RewardRow:
    """What a reward function (or an agent, rollout.agent) is told about a response's prompt, and where the row came
    from."""

    data_source: str
    ground_truth: object
    extra_info: object
    where: str  # "row 17 of 'train.parquet'"
    messages: tuple = ()  # the prompt's chat messages ({"role", "content"} dicts), as the data file has them

    def agent_row(self) -> dict:
        """The row as an agent gets it (verl's column names): {"prompt": the messages (a list of fresh dicts),
        "ground_truth", "data_source", "extra_info"}."""
        return {
            "prompt": [dict(message) for message in self.messages],
            "ground_truth": self.ground_truth,
            "data_source": self.data_source,
            "extra_info": self.extra_info,
        }


def score_texts(
    fn: RewardFunction, rows: Sequence[RewardRow], texts: Sequence[str]
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Scores (N,) fp32 and extras {key: (N,) fp32, NaN where a response's dict lacked the key}."""
    scores = np.empty(len(texts), dtype=np.float32)
    extras: dict[str, np.ndarray] = {}
    for i, (row, text) in enumerate(zip(rows, texts)):
        scores[i], extra = fn(row.data_source, text, row.ground_truth, row.extra_info, row.where)
        for key, value in extra.items():
            if key not in extras:
                extras[key] = np.full(len(texts), np.nan, dtype=np.float32)
            extras[key][i] = value
    return scores, extras
