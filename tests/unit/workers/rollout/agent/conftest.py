"""The agent endpoint's tests: SmolLM2's real tokenizer and chat template (the tiny GGUF of tests/tiny_gguf.py,
imported once per session by the tiny_smollm fixture) and a scripted TokenGenerator whose completions, log-probs and
versions each test chooses."""

from __future__ import annotations

import pytest

from dppo.workers.rollout.agent.generator import Completion, CompletionRequest, SamplingSettings
from dppo.workers.rollout.agent.ledger import AgentLimits

EOS = 2  # <|im_end|>, SmolLM2's end of turn


class ScriptedGenerator:
    """Returns its script's completions in order (a completion longer than the request's max_tokens is cut to it
    and finishes by "length", as an engine's would) and keeps every request it got."""

    def __init__(self, script: list[Completion]):
        self.script, self.requests = list(script), []

    async def generate(self, request: CompletionRequest) -> Completion:
        self.requests.append(request)
        c = self.script.pop(0)
        n = request.max_tokens
        if len(c.token_ids) > n:
            return Completion(c.token_ids[:n], c.logprobs[:n], c.versions[:n], "length")
        return c


@pytest.fixture(scope="session")
def tokenizer(tiny_smollm):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(tiny_smollm["model"]))


@pytest.fixture
def encode(tokenizer):
    """encode(text) -> the ids of text as a chat template's output is encoded (special tokens' text as those tokens)."""
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture
def sampled(tokenizer):
    """sampled(text_or_ids, versions, stop=True) -> a Completion: the ids (text encoded, or the ids given) + EOS where
    stop, log-probs distinct per token (-0.01, -0.02, ...), versions one int for all or one per token."""

    def make(what, versions, stop: bool = True) -> Completion:
        ids = tokenizer.encode(what, add_special_tokens=False) if isinstance(what, str) else list(what)
        ids = ids + [EOS] if stop else ids
        logprobs = [-0.01 * (i + 1) - 0.001 * len(ids) for i in range(len(ids))]
        per_token = [versions] * len(ids) if isinstance(versions, int) else list(versions)
        assert len(per_token) == len(ids)
        return Completion(ids, logprobs, per_token, "stop" if stop else "length")

    return make


@pytest.fixture
def endpoint_of(tokenizer):
    """endpoint_of(script, max_turns=8, max_response_tokens=2048, temperature=1.0, **endpoint kwargs) ->
    (AgentEndpoint, ScriptedGenerator), not started."""
    from dppo.workers.rollout.agent.endpoint import AgentEndpoint

    def make(script, max_turns=8, max_response_tokens=2048, temperature=1.0, max_tokens=256, **kwargs):
        generator = ScriptedGenerator(script)
        settings = SamplingSettings(temperature=temperature, stop_token_ids=(EOS,), max_tokens=max_tokens)
        limits = AgentLimits(max_turns=max_turns, max_response_tokens=max_response_tokens)
        return AgentEndpoint(generator, tokenizer, settings, limits, **kwargs), generator

    return make


@pytest.fixture
def run_agent():
    """run_agent(endpoint, agent, greedy=False) -> (what agent(client) returned, the session's Trajectory): serves
    endpoint in a fresh event loop for one session and one agent run."""
    import asyncio

    def run(endpoint, agent, greedy: bool = False):
        async def main():
            await endpoint.start()
            try:
                session = endpoint.new_session(greedy=greedy)
                client = endpoint.client(session)
                try:
                    result = await agent(client)
                finally:
                    await client.close()
                return result, endpoint.close_session(session)
            finally:
                await endpoint.stop()

        return asyncio.run(main())

    return run
