"""The hf engine's agent completions (engine.complete, engine.token_stream): token ids in, token ids out, each request
cut at its own max_tokens, its log-probs a teacher-forced forward of the weights that sampled it, greedy requests
decoded as alone. Left-padded prompts on GPT-2 (absolute positions: a wrong position id shows)."""

import numpy as np
import pytest
import torch

from dppo.models import response_log_probs
from dppo.workers.rollout.engines.base import BatchStream, TokenRequest
from dppo.workers.rollout.engines.hf import HFEngine

VOCAB, PAD, EOS = 24, 0, 3
CHUNK, NEW_TOKENS, TEMPERATURE = 4, 20, 1.3
PROMPTS = [(5, 6, 7, 8, 9), (10, 11), (12, 13, 14)]


def _config():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, tie_word_embeddings=False)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    return {k: v.clone() for k, v in GPT2LMHeadModel(_config()).state_dict().items()}


def _engine(weights, seed: int = 1234) -> HFEngine:
    engine = HFEngine(_config(), "float32", TEMPERATURE, NEW_TOKENS, EOS, PAD, micro_batch_size=5, partial_chunk=CHUNK)
    engine.load_weights(weights)
    engine.seed(seed)
    return engine


def _alone_logp(engine: HFEngine, prompt: tuple[int, ...], tokens: list[int]) -> torch.Tensor:
    """log pi of tokens after prompt, one unpadded row: the trainer's teacher-forced forward."""
    ids = torch.tensor([list(prompt) + tokens])
    return response_log_probs(engine.model, ids, len(tokens), TEMPERATURE, 1)[0]


def test_each_request_is_cut_at_its_own_max_tokens_and_scored_by_the_weights_that_sampled_it():
    weights = _weights(0)
    limits = [3, NEW_TOKENS, 7]
    cut = _engine(weights).complete([TokenRequest(p, m) for p, m in zip(PROMPTS, limits)], version=5)
    whole = _engine(weights).complete([TokenRequest(p, NEW_TOKENS) for p in PROMPTS], version=5)
    engine = _engine(weights)
    for prompt, limit, out, full in zip(PROMPTS, limits, cut, whole):
        assert 1 <= len(out.token_ids) <= limit
        assert out.token_ids == full.token_ids[:limit]  # the same random stream: a cut, not another sample
        stopped = out.token_ids[-1] == EOS
        assert out.finish_reason == ("stop" if stopped else "length"), (out.token_ids, out.finish_reason)
        assert EOS not in out.token_ids[:-1]
        assert out.versions == [5] * len(out.token_ids)
        want = _alone_logp(engine, prompt, out.token_ids)
        torch.testing.assert_close(torch.tensor(out.logprobs), want, rtol=0, atol=1e-5)
    assert any(o.finish_reason == "length" for o in cut), "the test needs a request cut by its max_tokens"


def test_greedy_requests_decode_as_alone_without_log_probs_and_keep_their_place_among_sampled_ones():
    engine = _engine(_weights(1))
    requests = [
        TokenRequest(PROMPTS[0], 6, greedy=True),
        TokenRequest(PROMPTS[1], 6),
        TokenRequest(PROMPTS[2], 9, True),
    ]
    outputs = engine.complete(requests, version=2)
    for request, out in zip(requests, outputs):
        if request.greedy:
            alone, mask = engine.greedy([np.asarray(request.prompt)])
            assert out.token_ids == alone[0][mask[0]].tolist()[: request.max_tokens]
            assert out.logprobs is None
        else:
            assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)


def test_a_batch_stream_runs_what_was_added_as_one_batch_and_follows_a_weight_change():
    old, new, newest = _weights(2), _weights(3), _weights(4)
    engine = _engine(old)
    polls, ready = [], {}  # ready: version -> weights, published for the next poll to find

    def refresh():
        polls.append(1)
        if not ready:
            return None
        version, weights = ready.popitem()

        def load() -> int:
            engine.load_weights(weights)
            return version

        return load

    stream = BatchStream(engine, 7, refresh)
    for key, prompt in enumerate(PROMPTS):
        stream.add(key, TokenRequest(prompt, NEW_TOKENS))
    with pytest.raises(KeyError, match="key 1"):
        stream.add(1, TokenRequest(PROMPTS[0], 2))
    assert stream.running == 3
    engine.generator.manual_seed(1234)
    real_poll = refresh

    def poll_then_publish():  # version 8 appears after the batch's first chunk
        load = real_poll()
        if len(polls) == 2:
            ready[8] = new
        return load

    stream._refresh = poll_then_publish
    outputs = dict(stream.step())
    assert sorted(outputs) == [0, 1, 2] and stream.running == 0 and stream.step() == []
    assert stream.version == 8  # found at the poll after the second chunk
    for out in outputs.values():  # tokens before the change: version 7; after it: 8
        n = len(out.token_ids)
        assert out.versions == [7] * min(n, 2 * CHUNK) + [8] * max(0, n - 2 * CHUNK)
    assert any(len(o.token_ids) > 2 * CHUNK for o in outputs.values()), "the test needs a response past the change"
    ready[9] = newest  # published between two batches (while an agent's tool ran): the next batch samples with it
    stream.add(0, TokenRequest(PROMPTS[0], 4))
    ((_, later),) = stream.step()
    assert later.versions == [9] * len(later.token_ids) and stream.version == 9


def test_a_request_with_no_tokens_to_make_is_refused():
    with pytest.raises(ValueError, match="max_tokens >= 1; got 0"):
        _engine(_weights(0)).complete([TokenRequest(PROMPTS[0], 0)], version=0)
