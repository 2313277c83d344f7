"""The agent endpoint's one interface to the generation engine: token ids in, sampled token ids out.

The endpoint never hands the engine text and never reads text back from it: a CompletionRequest carries the prompt's
token ids (the ledger's stitched sequence), a Completion the sampled ids with their behaviour log-probs and weight
versions. The rollout worker implements TokenGenerator over its engine (hf or vllm); tests use a scripted fake.

SamplingSettings is what the run samples with. It holds only what dppo's engines implement: the hf engine's sampler
(dppo.generation.sample_responses) samples the full softmax at rollout.temperature (0: greedy) and stops on one EOS
token; the vllm engine is driven with the same settings (SamplingParams(temperature, stop_token_ids=[eos])). So top_p
must be 1.0 and top_k off (-1 or 0): the fields exist so that the endpoint can name the run's value when a request
asks for another, and so that an engine that gains nucleus or top-k sampling has one place to say so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from dppo.workers.rollout.agent.errors import GeneratorContractError

FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class SamplingSettings:
    """How the run samples: every completion of every agent uses these (the endpoint refuses requests asking for
    others). temperature: rollout.temperature (> 0; greedy decoding is a session's property, for evaluation).
    stop_token_ids: the tokens that end a completion; the first is the chat template's end-of-turn token (SmolLM2,
    Qwen: <|im_end|>), which the ledger appends (masked) after a turn cut by length and aligns the template on.
    max_tokens: a request's max_tokens where it gives none (rollout.max_new_tokens)."""

    temperature: float
    stop_token_ids: tuple[int, ...]
    max_tokens: int
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(
                f"SamplingSettings.temperature={self.temperature!r}: expected a finite number > 0 (greedy decoding is "
                "asked per session: new_session(greedy=True))"
            )
        if isinstance(self.stop_token_ids, int) or not self.stop_token_ids:
            raise ValueError(
                f"SamplingSettings.stop_token_ids={self.stop_token_ids!r}: expected a non-empty tuple of token ids, "
                "the chat template's end-of-turn token first"
            )
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"SamplingSettings.max_tokens={self.max_tokens!r}: expected an int > 0")
        if self.top_p != 1.0:
            raise ValueError(
                f"SamplingSettings.top_p={self.top_p!r}: dppo's engines sample the full softmax; expected 1.0"
            )
        if self.top_k not in (-1, 0):
            raise ValueError(f"SamplingSettings.top_k={self.top_k!r}: dppo's engines have no top-k; expected -1 or 0")

    @property
    def end_token_id(self) -> int:
        """The chat template's end-of-turn token (the first stop token)."""
        return self.stop_token_ids[0]


@dataclass(frozen=True)
class CompletionRequest:
    """One completion to generate: sample up to max_tokens tokens after prompt_ids (greedy: argmax decoding, for an
    evaluation session; otherwise the run's SamplingSettings), stopping after a stop token."""

    prompt_ids: tuple[int, ...] | list[int]
    max_tokens: int
    greedy: bool = False  # evaluation decodes greedily; training samples at the run's temperature


@dataclass
class Completion:
    """What the engine sampled for one CompletionRequest."""

    token_ids: list[int]  # sampled tokens, the stop token included when one was sampled
    logprobs: list[float]  # behaviour log-prob of each token under the distribution it was sampled from
    versions: list[int]  # weight version each token was sampled with
    finish_reason: str  # "stop" (a stop token) or "length"


@runtime_checkable
class TokenGenerator(Protocol):
    """The engine as the endpoint sees it. generate is called concurrently (one call per in-flight request of every
    session): an implementation batches them as it likes. Contract, checked by check_completion: 1 <= len(token_ids)
    <= request.max_tokens; logprobs and versions as long as token_ids; finish_reason "stop" exactly when the last
    token is one of SamplingSettings.stop_token_ids (and no earlier one is), "length" otherwise."""

    async def generate(self, request: CompletionRequest) -> Completion: ...


def check_completion(completion: Completion, request: CompletionRequest, stop_token_ids: tuple[int, ...]) -> None:
    """Raise GeneratorContractError where completion breaks TokenGenerator's contract for request."""
    ids, n = completion.token_ids, len(completion.token_ids)
    if not 1 <= n <= request.max_tokens:
        raise GeneratorContractError(f"the generator returned {n} tokens for max_tokens={request.max_tokens}")
    if len(completion.logprobs) != n or len(completion.versions) != n:
        raise GeneratorContractError(
            f"the generator returned {n} tokens with {len(completion.logprobs)} logprobs and "
            f"{len(completion.versions)} versions; expected one of each per token"
        )
    if completion.finish_reason not in FINISH_REASONS:
        raise GeneratorContractError(
            f"the generator's finish_reason={completion.finish_reason!r}: expected one of {FINISH_REASONS}"
        )
    stopped = ids[-1] in stop_token_ids
    if stopped != (completion.finish_reason == "stop") or any(t in stop_token_ids for t in ids[:-1]):
        raise GeneratorContractError(
            f"the generator's finish_reason={completion.finish_reason!r} with last token {ids[-1]} and stop tokens "
            f"{list(stop_token_ids)}: 'stop' means the last token, and only it, is a stop token"
        )
