"""Evaluation of a policy on the run's evaluation prompts, shared by the trainer's greedy evaluation and `dppo eval`
(dppo.commands.evaluate).

    score_policy(policy, source, response_length, device, n=1, temperature=0.0, seed=0) -> {metric: value}
    score_engine(engine, source, n=1, seed=0, prompts_per_batch=...) -> {metric: value}
    EngineEvaluation(make_engine)                  trainer.eval_engine=rollout: an engine built once, reloaded per version

score_policy decodes source.eval_prompts() (greedy at temperature 0, else n samples per prompt at temperature,
seeded) with dppo.generation.sample_responses, the hf engine's own loop, over a torch model; score_engine decodes them
with a rollout engine (engine.greedy, or engine.sample at the engine's temperature), e.g. vLLM in its own dtype. Both
score them with source.score and source.eval_metrics: eval/* for an integer task, val/score/<data_source> (and
val/<extra>/<data_source>) for text data, as training reports them. With n > 1 each metric also comes as its best of
n: the mean over prompts of the best of a prompt's n responses' values (key: best@n after the first part, e.g.
val/best@8/acc/basic_arithmetic), which for a 0/1 value such as acc is pass@n.
"""

from __future__ import annotations

import itertools
from typing import Callable

import numpy as np
import torch

from dppo.data.source import PromptSource, Prompts, Scores
from dppo.generation import sample_responses
from dppo.batch import left_pad
from dppo.lora import LoraPublish
from dppo.models import as_state_dict
from dppo.workers.rollout.lora_sync import load_lora

EVAL_BATCH = 512  # prompts decoded at once
# (prompts of a batch, n) -> responses (len x n, R) and their mask, prompt-major; on the host
Decode = Callable[[Prompts, int], tuple[torch.Tensor, torch.Tensor]]


@torch.no_grad()
def score_policy(
    policy: torch.nn.Module,
    source: PromptSource,
    response_length: int,
    device: torch.device,
    n: int = 1,
    temperature: float = 0.0,
    seed: int = 0,
    batch_size: int = EVAL_BATCH,
) -> dict[str, float]:
    """The source's evaluation metrics of policy on source.eval_prompts() ({} if there are none): greedy at
    temperature 0 (n must be 1), else n responses per prompt sampled at temperature with a generator seeded by
    seed, every response scored and averaged as training's evaluation averages its prompts (and best@n, above)."""
    if n < 1 or (temperature == 0.0 and n != 1):
        raise ValueError(f"n={n} at temperature={temperature}: greedy decoding takes n=1, sampling n >= 1")
    generator = torch.Generator(device).manual_seed(seed) if temperature > 0 else None

    def decode(chunk: Prompts, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask = left_pad(chunk.repeat(n).token_ids, source.pad_token)
        responses, response_mask = sample_responses(
            policy,
            ids.to(device),
            response_length,
            temperature,
            generator,
            source.eos_token,
            source.pad_token,
            None if mask is None else mask.to(device),
        )
        return responses.cpu(), response_mask.cpu()

    return _score(decode, source, n, max(1, batch_size // n))


def score_engine(
    engine, source: PromptSource, n: int = 1, seed: int = 0, prompts_per_batch: int = EVAL_BATCH
) -> dict[str, float]:
    """The source's evaluation metrics of what a rollout engine (dppo.workers.rollout.engines) decodes on
    source.eval_prompts(): greedy with n=1, else n samples per prompt at the engine's temperature, each batch of
    prompts_per_batch prompts seeded with seed + its index (the engine's KV cache holds a batch's rows at once)."""
    if n < 1:
        raise ValueError(f"n={n}: one response per prompt or more")
    batches = itertools.count()

    def decode(chunk: Prompts, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        prompts = [np.asarray(ids) for ids in chunk.token_ids]
        if n == 1:
            return engine.greedy(prompts)
        engine.seed(seed + next(batches))
        samples = engine.sample(prompts, n)
        return samples.responses, samples.response_mask

    return _score(decode, source, n, prompts_per_batch)


def _score(decode: Decode, source: PromptSource, n: int, prompts_per_batch: int) -> dict[str, float]:
    prompts = source.eval_prompts()
    if len(prompts) == 0:
        return {}
    parts = []
    for start in range(0, len(prompts), prompts_per_batch):
        chunk = prompts[start : start + prompts_per_batch]
        responses, response_mask = decode(chunk, n)
        parts.append(source.score(chunk.repeat(n), responses.numpy(), response_mask.numpy()))
    every = Scores.concat(parts)  # one row per response, an extra's NaN on the batches without it
    metrics = source.eval_metrics(prompts.repeat(n), every)
    if n > 1:
        metrics.update(best_of(source, prompts, every, n))
    return metrics


def best_of(source: PromptSource, prompts: Prompts, scores: Scores, n: int) -> dict[str, float]:
    """The metrics of the best of each prompt's n responses (rows prompt-major): the score's and every extra's
    maximum over the n (NaN where none has the extra), keyed with best@n after the key's first part."""
    best = Scores(
        scores.scores.reshape(-1, n).max(1),
        {key: _nanmax_rows(values.reshape(-1, n)) for key, values in scores.extra.items()},
    )
    return {_best_key(key, n): value for key, value in source.eval_metrics(prompts, best).items()}


def _nanmax_rows(values: np.ndarray) -> np.ndarray:
    present = ~np.isnan(values)
    return np.where(present.any(1), np.where(present, values, -np.inf).max(1), np.nan)


def _best_key(key: str, n: int) -> str:
    head, _, rest = key.partition("/")
    return f"{head}/best@{n}/{rest}"


def score_agents(agents, source: PromptSource, version: int, n: int = 1, limit: int | None = None) -> dict[str, float]:
    """The source's evaluation metrics of an agent (rollout.agent) run on each of source.eval_prompts() through
    agents (a dppo.workers.rollout.agent.AgentRollout over an engine that holds the weights of version): once and
    greedily with n=1, else n times sampled at the engine's temperature (and each metric's best of n, as score_policy).
    val/score/<data_source> is its rewards' mean, val/agent/<key>/<data_source> the mean of each of its agent/* values
    (the agent's own extras, e.g. tool use, and agent/errors, agent/turns_mean, ...). limit: the first that many held-out
    rows only."""
    prompts = source.eval_prompts()[:limit]
    if len(prompts) == 0:
        return {}
    runs = agents.run(prompts.meta, n, version, greedy=n == 1)  # prompt-major: each row's n runs in a row
    stats = [run.stats() for run in runs]
    keys = sorted({key for s in stats for key in s})
    extra = {key: np.array([s.get(key, np.nan) for s in stats], dtype=np.float32) for key in keys}
    scores = Scores(np.array([run.reward for run in runs], dtype=np.float32), extra)
    metrics = source.eval_metrics(prompts.repeat(n), scores)
    if n > 1:
        metrics.update(best_of(source, prompts, scores, n))
    return metrics


class EngineEvaluation:
    """trainer.eval_engine=rollout: the trainer's evaluation decoded by an engine of the rollout's kind and dtype
    (rollout.name, rollout.dtype), built in this process by make() at the first evaluation (after the local rollout
    workers were forked) and given the published weights when a newer version is evaluated. With rollout.agent,
    make_agents(engine) builds the agents' runtime over it, and the evaluation runs the agent (score_agents)."""

    def __init__(self, make: Callable[[], object], make_agents: Callable[[object], object] | None = None):
        self._make, self._make_agents = make, make_agents
        self.engine = None
        self.agents = None
        self.version: int | None = None
        self.holds: str | None = None  # the LoRA base the engine holds merged (lora_sync.holds_id), None: none

    def __call__(self, source: PromptSource, weights: Callable[[], object], version: int) -> dict[str, float]:
        """Greedy metrics of the weights of version (weights() gives what their publish carries: a state dict,
        SharedWeights or a LoRA policy's LoraPublish; asked for only when new). A LoRA publish loads as a rollout
        worker's does (dppo.workers.rollout.lora_sync): the merged model once, then the adapter's targets alone."""
        if len(source.eval_prompts()) == 0:
            return {}
        if self.engine is None:
            self.engine = self._make()
        if self.version != version:
            published, self.version = weights(), None  # known again once the load has succeeded
            if isinstance(published, LoraPublish):
                self.holds = load_lora(self.engine, published, self.holds)[1]
            else:
                self.holds = None
                self.engine.load_weights(as_state_dict(published))
            self.version = version
        if self._make_agents is None:
            return score_engine(self.engine, source)
        if self.agents is None:
            self.agents = self._make_agents(self.engine)
        return score_agents(self.agents, source, version)

    def close(self) -> None:
        if self.agents is not None:
            self.agents.close()
            self.agents = None
        if self.engine is not None:
            self.engine.close()
            self.engine = None
