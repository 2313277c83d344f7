"""Evaluation of a policy on the run's evaluation prompts, shared by the trainer's greedy evaluation and `dppo eval`
(dppo.commands.evaluate).

    score_policy(policy, source, response_length, device, n=1, temperature=0.0, seed=0) -> {metric: value}

decodes source.eval_prompts() (greedy at temperature 0, else n samples per prompt at temperature, seeded) with
dppo.generation.sample_responses, the rollout's own loop, and scores them with source.score and
source.eval_metrics: eval/* for an integer task, val/score/<data_source> for text data, as training reports them.
"""

from __future__ import annotations

import numpy as np
import torch

from dppo.data.source import PromptSource, Scores
from dppo.generation import sample_responses
from dppo.batch import left_pad

EVAL_BATCH = 512  # prompts decoded at once


@torch.no_grad()
def score_policy(policy: torch.nn.Module, source: PromptSource, response_length: int, device: torch.device,
                 n: int = 1, temperature: float = 0.0, seed: int = 0, batch_size: int = EVAL_BATCH) -> dict[str, float]:  # fmt: skip
    """The source's evaluation metrics of policy on source.eval_prompts() ({} if there are none): greedy at
    temperature 0 (n must be 1), else n responses per prompt sampled at temperature with a generator seeded by
    seed, every response scored and averaged as training's evaluation averages its prompts."""
    if n < 1 or (temperature == 0.0 and n != 1):
        raise ValueError(f"n={n} at temperature={temperature}: greedy decoding takes n=1, sampling n >= 1")
    prompts = source.eval_prompts()
    if len(prompts) == 0:
        return {}
    if n > 1:
        prompts = prompts.repeat(n)
    generator = torch.Generator(device).manual_seed(seed) if temperature > 0 else None
    scores, extra = [], []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        ids, mask = left_pad(chunk.token_ids, source.pad_token)
        responses, response_mask = sample_responses(
            policy, ids.to(device), response_length, temperature, generator, source.eos_token, source.pad_token,
            None if mask is None else mask.to(device),
        )  # fmt: skip
        scored = source.score(chunk, responses.cpu().numpy(), response_mask.cpu().numpy())
        scores.append(scored.scores)
        extra.append(scored.extra)
    return source.eval_metrics(prompts, Scores(np.concatenate(scores), _concat_extra(extra)))


def _concat_extra(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    keys = sorted({key for part in parts for key in part})
    return {key: np.concatenate([part[key] for part in parts if key in part]) for key in keys}
