"""Where prompts come from and how responses are scored: one interface for integer tasks and for text data.

    source.sampler(seed) -> prompts; prompts.start_ticket(first, seed); prompts.sample(num) -> Prompts   (training)
    source.score(prompts, responses, response_mask) -> Scores                            (on the rollout workers)
    source.eval_prompts() -> Prompts, source.eval_metrics(prompts, scores) -> {key: value} (greedy evaluation)
    source.vocab_size, eos_token, pad_token, response_length

The trainer builds the source once (dppo.data.make_prompt_source) and sends the object itself to the rollout workers.
TaskSource wraps a dppo.tasks.Task (prompts of one length, the demo); dppo.data.text.TextSource reads
verl-format parquet files through the model's tokenizer and chat template (data.train_files).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from dppo.tasks import PromptSampler, Task, held_out_prompts, make_task


@dataclass
class Prompts:
    """A batch of prompts: token ids and whatever the source's score() needs to know about each row."""

    token_ids: np.ndarray | list[np.ndarray]
    """(N, P) int64 when every prompt has the same length, else N arrays (P_i,) of token ids."""

    meta: list | None = None
    """Per row, what score() needs (text: the reward row); None for integer tasks."""

    def __len__(self) -> int:
        return len(self.token_ids)

    def __getitem__(self, rows: slice) -> Prompts:
        return Prompts(self.token_ids[rows], None if self.meta is None else self.meta[rows])

    def repeat(self, n: int) -> Prompts:
        """Each row n times in a row (n responses per prompt)."""
        if isinstance(self.token_ids, np.ndarray):
            ids = np.repeat(self.token_ids, n, axis=0)
        else:
            ids = [row for row in self.token_ids for _ in range(n)]
        return Prompts(ids, None if self.meta is None else [m for m in self.meta for _ in range(n)])


@dataclass
class Scores:
    """Rewards of N responses and the reward function's extra numbers (logged as reward/extra/<key> means)."""

    scores: np.ndarray  # (N,) fp32
    extra: dict[str, np.ndarray] = field(default_factory=dict)  # key -> (N,) fp32, NaN where absent

    @classmethod
    def concat(cls, parts: list[Scores]) -> Scores:
        """The rows of parts in order. An extra that some parts lack (a reward that returns a key for some responses
        only, none of them in a part) is NaN on those parts' rows, so every extra keeps one value per row."""
        keys = sorted({key for part in parts for key in part.extra})
        extra = {
            key: np.concatenate([part.extra.get(key, np.full(len(part.scores), np.nan, np.float32)) for part in parts])
            for key in keys
        }
        return cls(np.concatenate([part.scores for part in parts]), extra)


class TrainingPrompts(Protocol):
    """What source.sampler() returns: the training prompts of the replay buffer's tickets.

    start_ticket(first, prompt_seed) positions it for a ticket whose first group has grant index first, with a
    seed drawn from (trainer.seed, first): what a ticket gets depends on those alone, not on the worker."""

    def start_ticket(self, first: int, prompt_seed: int) -> None: ...

    def sample(self, num: int) -> Prompts: ...


class PromptSource(ABC):
    """Training prompts, a scorer and an evaluation set; see the module docstring."""

    vocab_size: int  # token ids lie below this; the model must have at least this many
    eos_token: int | None  # generation of a response stops after it (None: always response_length tokens)
    pad_token: int  # fills prompts on the left and responses after their end
    response_length: int  # response tokens when rollout.max_new_tokens is null
    prompt_length: int  # tokens of the longest prompt (training or evaluation)

    @abstractmethod
    def sampler(self, seed) -> TrainingPrompts:
        """The training prompts of one rollout worker (seed: what a random sampler starts from)."""

    @abstractmethod
    def score(self, prompts: Prompts, responses: np.ndarray, response_mask: np.ndarray) -> Scores:
        """Rewards of responses (N, R) with their mask (N, R) to prompts (N rows)."""

    @abstractmethod
    def eval_prompts(self) -> Prompts:
        """The prompts of the greedy evaluation (may be empty)."""

    @abstractmethod
    def eval_metrics(self, prompts: Prompts, scores: Scores) -> dict[str, float]:
        """The evaluation's metrics from the scores of all eval_prompts()."""


class _TaskPrompts:
    def __init__(self, sampler: PromptSampler):
        self._sampler = sampler

    def start_ticket(self, first: int, prompt_seed: int) -> None:
        self._sampler.rng = np.random.default_rng(prompt_seed)

    def sample(self, num: int) -> Prompts:
        return Prompts(self._sampler.sample(num))


class TaskSource(PromptSource):
    """A dppo.tasks.Task: random prompts of one length, never one of the held-out evaluation prompts."""

    def __init__(self, task: Task, held_out: np.ndarray):
        self.task, self.held_out = task, held_out
        self.vocab_size, self.eos_token, self.pad_token = task.vocab_size, task.eos_token, 0
        self.response_length = task.answer_length
        self.prompt_length = task.sample_prompts(np.random.default_rng(0), 1).shape[1]

    @classmethod
    def from_config(cls, task_cfg, seed: int, eval_prompts: int) -> TaskSource:
        """task_cfg: the config's task section; eval_prompts held-out prompts drawn with the run's seed."""
        task = make_task(task_cfg.name, task_cfg.length)
        return cls(task, held_out_prompts(task, seed, eval_prompts))

    def sampler(self, seed) -> _TaskPrompts:
        return _TaskPrompts(PromptSampler(self.task, seed, self.held_out))

    def score(self, prompts: Prompts, responses: np.ndarray, response_mask: np.ndarray) -> Scores:
        return Scores(self.task.rewards(np.asarray(prompts.token_ids), responses, response_mask))

    def eval_prompts(self) -> Prompts:
        return Prompts(self.held_out)

    def eval_metrics(self, prompts: Prompts, scores: Scores) -> dict[str, float]:
        if len(prompts) == 0:
            return {}
        reward = scores.scores
        return {
            "eval/reward": float(reward.mean()),
            "eval/accuracy": float((reward >= 1.0).mean()),
            "eval/prompts": float(len(reward)),
        }
