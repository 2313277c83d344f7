"""The rollout engine interface: what a rollout worker needs from whatever generates its samples.

A worker (dppo.workers.rollout.worker.RolloutGenerator) draws a ticket's prompts, hands them to its engine and
scores what comes back; the engine only samples. Engines: `hf` (dppo's own sampler over a transformers model,
this process) and `vllm` (vllm.LLM inside this process), chosen by rollout.name.

Agents (dppo.workers.rollout.agent) ask for completions one at a time, token ids in and token ids out, as they get to
each turn: engine.token_stream(version, refresh) takes TokenRequests as they come (add) and returns each one's
TokenOutput once it is done (step). An engine with continuous batching (vLLM) adds a request to the batch in flight;
the default stream runs what was added since the last step as one batch (engine.complete).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from dppo.workers.rollout.engines.spec import EngineSettings, EngineSpec
from dppo.workers.sync_check import TensorPrint, WeightFingerprint


@dataclass
class Samples:
    """n responses to each of G prompts: B = G n rows, prompt-major (rows g n .. g n + n - 1 answer prompt g)."""

    responses: torch.Tensor  # (B, R) long, pad_token after a response's end; R = the longest response
    response_mask: torch.Tensor  # (B, R) bool, 1 on response tokens (the EOS that ended one included)
    behav_logp: torch.Tensor  # (B, R) fp32, log pi_behav of each token at the sampling temperature; 0 on padding
    # (B, R) long, the policy version of the weights that sampled each token (rollout.partial_rollout: a response
    # may span several); on padding the version in effect when that position was reached
    versions: torch.Tensor | None = None


# A rollout.partial_rollout refresh: called by an engine between decode chunks; None (no newer weights), or a
# function that loads the newer weights into the engine and returns their version. The engine calls the function
# once it has done what it must with the old weights (the hf engine scores the tokens they sampled).
Refresh = Callable[[], Callable[[], int] | None]


@dataclass
class WeightSync:
    """What one load of new weights into an engine cost."""

    seconds: float  # wall time of the load (and of whatever the engine must do after it, e.g. a cache reset)
    bytes: int  # bytes handed to the engine (all tensors for a full sync; the changed ones for a delta sync)
    changed_fraction: float = 1.0  # engine-dtype elements that differ from the engine's previous weights
    verify_seconds: float | None = None  # the check of the loaded weights (rollout.verify_sync), None: not checked


@dataclass(frozen=True)
class TokenRequest:
    """One completion an agent asked for: the prompt's token ids (every earlier turn included), at most max_tokens new
    tokens; greedy: temperature 0 and no log-probs (evaluation), else sampled at the engine's temperature."""

    prompt: tuple[int, ...]
    max_tokens: int
    greedy: bool = False


@dataclass
class TokenOutput:
    """What a TokenRequest got: the tokens sampled (the stop token included where one ended it), each one's log-prob
    under the distribution it was sampled from (None for a greedy request), the version of the weights that sampled
    each, and why it ended: "stop" (the stop token) or "length" (max_tokens)."""

    token_ids: list[int]
    logprobs: list[float] | None
    versions: list[int]
    finish_reason: str


class TokenStream(ABC):
    """Completions of TokenRequests that arrive while others run (see the module docstring). Not thread-safe: one
    thread adds and steps."""

    @abstractmethod
    def add(self, key: int, request: TokenRequest) -> None:
        """Start request; its output comes back from a later step() under key (a non-negative int, unique among those
        running)."""

    @abstractmethod
    def step(self) -> list[tuple[int, TokenOutput]]:
        """Advance the requests added so far; the (key, output) of those that finished."""

    @property
    @abstractmethod
    def running(self) -> int:
        """Requests added and not yet returned by step()."""

    @property
    @abstractmethod
    def version(self) -> int:
        """The version of the weights the stream samples with now (a refresh may have loaded newer ones)."""


class BatchStream(TokenStream):
    """The default TokenStream: each step() runs every request added since the last one as one batch of
    engine.complete (no request joins a batch in flight). With a refresh (rollout.partial_rollout), newer weights are
    looked for before each batch as well as between its decode chunks: a multi-turn agent's next turn samples with
    the weights published while its last tool ran."""

    def __init__(self, engine: RolloutEngine, version: int, refresh: Refresh | None) -> None:
        self._engine, self._version, self._refresh = engine, version, refresh
        self._pending: dict[int, TokenRequest] = {}

    def add(self, key: int, request: TokenRequest) -> None:
        if key in self._pending:
            raise KeyError(f"a request with key {key!r} is running already")
        self._pending[key] = request

    def step(self) -> list[tuple[int, TokenOutput]]:
        if not self._pending:
            return []
        load = self._refreshing()  # newer weights published since the last batch: this batch samples with them
        if load is not None:
            load()
        keys, requests = list(self._pending), list(self._pending.values())
        self._pending.clear()
        outputs = self._engine.complete(requests, self._version, self._refreshing)
        return list(zip(keys, outputs))

    def _refreshing(self):
        """The worker's refresh, noting the version that a load it hands out brings."""
        if self._refresh is None:
            return None
        load = self._refresh()
        if load is None:
            return None

        def loaded() -> int:
            self._version = load()
            return self._version

        return loaded

    @property
    def running(self) -> int:
        return len(self._pending)

    @property
    def version(self) -> int:
        return self._version


class RolloutEngine(ABC):
    """Samples responses with per-token behavior log-probs; loads new weights in place.

    A subclass of the user's own runs with rollout.name=package.module:Class (dppo.workers.rollout.engines.registry):
    built by from_settings, declared by its `spec` where it sets one (else the default EngineSpec)."""

    # What dppo asks of a user's engine besides sampling (dppo.workers.rollout.engines.spec.EngineSpec): None, the
    # defaults (nothing to install, an hf-like memory estimate, full weight syncs, the worker's device). The builtin
    # engines declare theirs in their modules (hf.SPEC, vllm.SPEC), so that a subclass of one gets the defaults.
    spec: ClassVar[EngineSpec | None] = None

    @classmethod
    def from_settings(cls, settings: EngineSettings, model_config, device: torch.device) -> RolloutEngine:
        """A new engine for a worker: cls(settings, model_config, device), the constructor signature an engine of
        the user's own has unless it overrides this. model_config: the trainer model's transformers config (the
        weights arrive with load_weights); device: the worker's (its GPU where Ray gave it one, else the CPU)."""
        return cls(settings, model_config, device)

    # Whether a run's metrics report this engine's weight loads (timing_s/rollout_weight_sync,
    # rollout/weight_sync_bytes, rollout/weight_sync_changed_frac). The hf engine's load is a load_state_dict
    # into its own model copy: not reported, so its runs' records stay what they were (a resumed run's records
    # equal an uninterrupted run's, timings aside). The worker's check of a load (rollout.verify_sync:
    # timing_s/weight_sync_verify, a timing) is reported with any engine.
    reports_sync: bool = True

    @abstractmethod
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> WeightSync:
        """Make the engine sample from these weights (transformers names, the trainer's dtype) from now on."""

    # The dtype every weight the engine holds has (a LoRA merge is rounded straight to it, never kept in the trainer's
    # wider dtype first: dppo.workers.rollout.lora_sync); None: unknown, the merge keeps the base's dtype.
    held_dtype: torch.dtype | None = None

    # Whether load_partial may be called: a LoRA publish then loads the adapter's target modules alone
    # (dppo.workers.rollout.lora_sync); an engine without it loads the whole merged model every time.
    loads_partial: bool = False

    def load_partial(self, tensors: dict[str, torch.Tensor], held: dict[str, torch.Tensor]) -> WeightSync:
        """Replace these tensors (transformers names) in place, the others staying as loaded last. held: the whole
        weights those others are (an engine that reloads fused layers whole takes their other tensors from it)."""
        raise NotImplementedError(f"{type(self).__name__} loads whole weights only")

    @property
    def accepts_delta(self) -> bool:
        """Whether load_delta may be called now: rollout.weight_sync=delta and weights loaded before."""
        return False

    def load_delta(self, delta) -> WeightSync:
        """Apply a dppo.workers.weight_delta.WeightDelta computed against the weights loaded last."""
        raise NotImplementedError(f"{type(self).__name__} loads full weights only")

    @abstractmethod
    def held_prints(self, expected: WeightFingerprint) -> dict[str, TensorPrint]:
        """The prints (dppo.workers.weight_fingerprint) of the weights the engine holds now, read back from the engine
        itself (never from what it was handed), by checkpoint name, in expected's dtype. expected: the published
        version's fingerprint, whose shapes tell fused tensors apart."""

    @abstractmethod
    def seed(self, seed: int) -> None:
        """Seed the samples that follow (a ticket's seed: its samples depend on it and the weights only)."""

    @abstractmethod
    def sample(self, prompts: list[np.ndarray], n: int, version: int = 0, refresh: Refresh | None = None) -> Samples:
        """n responses to each prompt (G token-id arrays, any lengths), their mask, behavior log-probs and per-token
        versions (version: that of the weights loaded now). refresh (rollout.partial_rollout): polled once per
        decode chunk (rollout.partial_chunk tokens); where it hands newer weights, every unfinished response keeps
        its tokens and their log-probs and continues under the new weights; finished ones are not touched."""

    @abstractmethod
    def greedy(self, prompts: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """One greedy response to each prompt (temperature 0, no random draw): responses (G, R) long and their mask
        (G, R) bool, on the host. ReMax's baseline: scored, never trained on, so no log-probs."""

    def complete(self, requests: list[TokenRequest], version: int, refresh: Refresh | None = None) -> list[TokenOutput]:
        """One batch of agent completions (TokenRequests of any lengths), in order; version: that of the weights
        loaded now; refresh (rollout.partial_rollout): as sample()'s, for the sampled requests."""
        raise NotImplementedError(f"the {type(self).__name__} rollout engine does not serve agents (rollout.agent)")

    def token_stream(self, version: int, refresh: Refresh | None = None) -> TokenStream:
        """A stream of agent completions over the weights of version loaded now (see the module docstring)."""
        return BatchStream(self, version, refresh)

    def close(self) -> None:
        """Free what the engine holds (processes, caches); the default holds nothing that needs it."""


def state_dict_bytes(state_dict: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state_dict.values())
