"""Continuous batching over the vllm engine: requests join the batch in flight, one decode step at a time.

VLLMTokenStream drives vLLM's engine step by step (llm_engine.add_request / step): a request added between two steps
is scheduled at the next one, beside those already running, and each step returns what finished. It serves both
the agents' completions (engine.token_stream) and rollout.partial_rollout's sample() (every row of a ticket a request
of its own).

rollout.partial_rollout: every rollout.partial_chunk steps the worker's refresh is asked for newer weights. Where it
hands some, the running requests are aborted (their tokens and log-probs so far kept), the weights loaded (the prefix
cache reset as after any sync) and each resumed as a new request of prompt + its tokens so far, max_tokens reduced and
a seed derived from the ticket's, the request's key, the tokens so far and the new version. vLLM 0.32 has no pause
that keeps a request's KV cache across a weight reload, and that cache was computed by the old weights: resuming
recomputes it (one prefill) either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dppo.workers.rollout.engines.base import Refresh, TokenOutput, TokenRequest, TokenStream


@dataclass
class _Running:
    """A request in flight: what it asked for, its tokens, their log-probs and versions so far, and the vLLM request
    that carries it on now (its id, and how many of the tokens it was started with)."""

    request: TokenRequest
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    request_id: str = ""
    started_with: int = 0


class VLLMTokenStream(TokenStream):
    """See the module docstring. engine: a dppo VLLMEngine (its llm, sampling parameters and ticket seed)."""

    def __init__(self, engine, version: int, refresh: Refresh | None, chunk: int) -> None:
        self._engine = engine
        self._core = engine.llm.llm_engine
        self._version, self._refresh, self._chunk = version, refresh, chunk
        self._running: dict[int, _Running] = {}
        self._by_request_id: dict[str, int] = {}
        self._steps = 0

    def add(self, key: int, request: TokenRequest, seed: int | None = None) -> None:
        """seed: the request's sampling seed (default: drawn from the ticket's seed and key, a non-negative int)."""
        if key in self._running:
            raise KeyError(f"a request with key {key!r} is running already")
        if request.max_tokens < 1:
            raise ValueError(f"a completion needs max_tokens >= 1; got {request.max_tokens}")
        if seed is None:
            seed = _seed(self._engine.ticket_seed, key)
        self._running[key] = running = _Running(request)
        self._start(key, running, seed)

    def _start(self, key: int, running: _Running, seed: int) -> None:
        done = len(running.tokens)
        request_id = f"dppo-{self._engine.ticket_seed}-{key}-{done}"  # outputs and aborts name it
        prompt = [int(t) for t in running.request.prompt] + running.tokens
        params = self._engine.request_params(running.request.max_tokens - done, seed, running.request.greedy)
        self._core.add_request(request_id, {"prompt_token_ids": prompt}, params)
        running.request_id, running.started_with = request_id, done
        self._by_request_id[request_id] = key

    def step(self) -> list[tuple[int, TokenOutput]]:
        finished = []
        for out in self._core.step():
            key = self._by_request_id.get(out.request_id)
            if key is None:
                continue
            running, c = self._running[key], out.outputs[0]
            new = list(c.token_ids)  # cumulative: every token of this vLLM request so far
            del running.tokens[running.started_with :], running.logprobs[running.started_with :]
            del running.versions[running.started_with :]
            running.tokens += new
            if not running.request.greedy:
                running.logprobs += [step[t].logprob for step, t in zip(c.logprobs, new)]
            running.versions += [self._version] * len(new)
            if out.finished:
                del self._running[key], self._by_request_id[out.request_id]
                logprobs = None if running.request.greedy else running.logprobs
                finished.append((key, TokenOutput(running.tokens, logprobs, running.versions, c.finish_reason)))
        self._steps += 1
        if self._refresh is not None and self._running and self._steps % self._chunk == 0:
            self._reload_if_newer()
        return finished

    def _reload_if_newer(self) -> None:
        """The refresh's newer weights, if any: every sampled request in flight resumed under them (greedy ones are
        evaluation's: no refresh reaches them)."""
        load = self._refresh()
        if load is None:
            return
        self._core.abort_request([r.request_id for r in self._running.values()])
        self._by_request_id.clear()
        self._version = load()  # the newer weights; the prefix cache reset
        for key in sorted(self._running):
            running = self._running[key]
            state = np.random.SeedSequence([self._engine.ticket_seed, key, len(running.tokens), self._version])
            self._start(key, running, int(state.generate_state(1)[0]) & 0x3FFFFFFF)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def version(self) -> int:
        return self._version


def _seed(ticket_seed: int, key: int) -> int:
    # < 2**31 - n: vLLM adds the sample index to the seed of a request
    return int(np.random.SeedSequence([ticket_seed, 0x5EED, key]).generate_state(1)[0]) & 0x3FFFFFFF
