"""Tasks on integer tokens: a prompt generator and a reward function in [0, 1], kept in a small registry.

The built-in tasks (copy, reverse, sort) prompt with [BOS, d_1, ..., d_L, SEP], digits d_i in 0..9 being
token ids 0..9, and expect L answer digits. The reward is the fraction of answer positions right (partial
credit); a uniformly random policy over the 12-token vocabulary scores about 1/12.

A user task is a Task built from a prompt function and a reward function, registered with
register_task(name, make) where make(length) -> Task; `task.name=module:function` also works from the
command line (the function is called with task.length).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

NUM_DIGITS = 10
BOS_TOKEN = 10
SEP_TOKEN = 11
DIGIT_VOCAB_SIZE = 12  # digits + BOS + SEP


class UnknownTaskError(KeyError):
    """task.name is neither registered nor an importable module:function."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0])


PromptFn = Callable[[np.random.Generator, int], np.ndarray]
RewardFn = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Task:
    """A prompt generator and a reward function over token ids."""

    name: str
    prompt_fn: PromptFn
    """(rng, num) -> (num, P) int64 prompt tokens (all prompts of a task have the same length P)."""

    reward_fn: RewardFn
    """(prompts (N, P), responses (N, R), response_mask (N, R)) -> (N,) rewards in [0, 1]."""

    answer_length: int
    """Response tokens to generate when rollout.max_new_tokens is null."""

    vocab_size: int
    """Token ids lie in [0, vocab_size); the tiny model is built with this vocabulary."""

    eos_token: int | None = None
    """Generation of a response stops after this token (None: always answer_length tokens)."""

    distinct_prompts: int | None = None
    """How many distinct prompts prompt_fn can make (None: unknown). Known, it bounds trainer.eval_prompts by
    counting; unknown, the config check draws the held-out set to find out."""

    def sample_prompts(self, rng: np.random.Generator, num: int) -> np.ndarray:
        prompts = np.asarray(self.prompt_fn(rng, num), dtype=np.int64)
        if prompts.ndim != 2 or prompts.shape[0] != num:
            raise ValueError(f"task {self.name!r}: prompt_fn returned shape {prompts.shape}; expected ({num}, P)")
        return prompts

    def rewards(self, prompts: np.ndarray, responses: np.ndarray, response_mask: np.ndarray) -> np.ndarray:
        scores = np.asarray(self.reward_fn(prompts, responses, response_mask), dtype=np.float32)
        if scores.shape != (prompts.shape[0],):
            raise ValueError(
                f"task {self.name!r}: reward_fn returned shape {scores.shape}; expected ({prompts.shape[0]},)"
            )
        return scores


def digit_task(name: str, length: int, answer_fn: Callable[[np.ndarray], np.ndarray]) -> Task:
    """A task whose answer is answer_fn(digits) for a prompt [BOS, digits, SEP] of length digits."""

    def prompt_fn(rng: np.random.Generator, num: int) -> np.ndarray:
        digits = rng.integers(0, NUM_DIGITS, size=(num, length), dtype=np.int64)
        bos = np.full((num, 1), BOS_TOKEN, dtype=np.int64)
        sep = np.full((num, 1), SEP_TOKEN, dtype=np.int64)
        return np.concatenate([bos, digits, sep], axis=1)

    def reward_fn(prompts: np.ndarray, responses: np.ndarray, response_mask: np.ndarray) -> np.ndarray:
        answers = answer_fn(prompts[:, 1 : 1 + length])  # (N, L)
        width = min(length, responses.shape[1])
        hits = (responses[:, :width] == answers[:, :width]) & (response_mask[:, :width] != 0)
        return hits.sum(axis=1) / length  # missing answer positions count as wrong

    # counted only while an int64 count of eval prompts could reach it (10**length of a huge length is itself huge)
    distinct = NUM_DIGITS**length if length <= 18 else None
    return Task(
        name, prompt_fn, reward_fn, answer_length=length, vocab_size=DIGIT_VOCAB_SIZE, distinct_prompts=distinct
    )


TASKS: dict[str, Callable[[int], Task]] = {}


def register_task(name: str, make: Callable[[int], Task]) -> None:
    """Register make(length) -> Task under name (then task.name=<name> selects it); re-registering replaces it."""
    TASKS[name] = make


register_task("copy", lambda length: digit_task("copy", length, lambda d: d))
register_task("reverse", lambda length: digit_task("reverse", length, lambda d: d[:, ::-1]))
register_task("sort", lambda length: digit_task("sort", length, lambda d: np.sort(d, axis=1)))


def _import_factory(spec: str) -> Callable[[int], Task]:
    module_name, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise UnknownTaskError(f"task {spec!r}: cannot import {attr!r} from {module_name!r} ({err})") from None


def task_exists(name: str) -> bool:
    """True if make_task(name, ...) can resolve the name (a registered name or an importable module:function)."""
    if name in TASKS:
        return True
    if ":" not in name:
        return False
    try:
        _import_factory(name)
    except UnknownTaskError:
        return False
    return True


def make_task(name: str, length: int) -> Task:
    """The task registered as name (or the factory module:function) for prompts of length digits."""
    if name in TASKS:
        make = TASKS[name]
    elif ":" in name:
        make = _import_factory(name)
    else:
        raise UnknownTaskError(f"unknown task {name!r}; registered tasks: {', '.join(TASKS)} (or module:function)")
    task = make(length)
    if not isinstance(task, Task):
        raise TypeError(f"task factory for {name!r} returned {type(task).__name__}; expected a dppo.tasks.Task")
    return task


def held_out_prompts(task: Task, seed: int, num: int, max_draws: int = 100) -> np.ndarray:
    """(n <= num, P) distinct evaluation prompts fixed by seed; fewer if the task has few distinct prompts."""
    rng = np.random.default_rng([seed, 0xE7A1])
    seen: dict[bytes, np.ndarray] = {}
    for _ in range(max_draws):
        for row in task.sample_prompts(rng, num):
            seen.setdefault(row.tobytes(), row)
        if len(seen) >= num:
            break
    rows = list(seen.values())[:num]
    width = task.sample_prompts(np.random.default_rng(0), 1).shape[1]
    return np.stack(rows) if rows else np.zeros((0, width), dtype=np.int64)


class PromptSampler:
    """Draws training prompts from a task, never one of the held-out evaluation prompts."""

    def __init__(self, task: Task, seed, held_out: np.ndarray | None = None, max_draws: int = 1000):
        self.task = task
        self.rng = np.random.default_rng(seed)
        self.max_draws = max_draws
        self._held_out = {row.tobytes() for row in held_out} if held_out is not None else set()

    def sample(self, num: int) -> np.ndarray:
        """(num, P) prompts outside the held-out set."""
        kept: list[np.ndarray] = []
        for _ in range(self.max_draws):
            kept.extend(row for row in self.task.sample_prompts(self.rng, num) if row.tobytes() not in self._held_out)
            if len(kept) >= num:
                return np.stack(kept[:num])
        raise RuntimeError(
            f"task {self.task.name!r}: {self.max_draws} draws gave only {len(kept)} of {num} prompts outside "
            f"the {len(self._held_out)} held-out ones; lower trainer.eval_prompts"
        )
