"""rollout.partial_rollout on the hf engine: a response carries on across a weight change between decode chunks.

The tokens before the change are those of a run without it, and their log-probs are a teacher-forced forward of the
old weights; the tokens after it continue from a KV cache rebuilt under the new weights (they equal a fresh sampler
of the new weights started on prompt + the tokens so far, with the random stream where the change found it), and
their log-probs are a teacher-forced forward of the new weights, bitwise (fp32). Responses finished before the
change are not touched. Left-padded prompts on GPT-2 (absolute positions: a wrong position id shows)."""

import numpy as np
import pytest
import torch

from dppo.batch import left_pad
from dppo.generation import sample_responses
from dppo.models import response_log_probs
from dppo.workers.rollout.engines.hf import HFEngine

VOCAB, PAD, EOS = 24, 0, 3
CHUNK, NEW_TOKENS, TEMPERATURE = 4, 20, 1.3
PROMPTS = [np.array([5, 6, 7, 8, 9]), np.array([10, 11]), np.array([12, 13, 14])]
N = 4  # 12 rows, 3 prompt lengths


def _config():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, tie_word_embeddings=False)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    return {k: v.clone() for k, v in GPT2LMHeadModel(_config()).state_dict().items()}


def _engine(weights) -> HFEngine:
    engine = HFEngine(_config(), "float32", TEMPERATURE, NEW_TOKENS, EOS, PAD, micro_batch_size=5, partial_chunk=CHUNK)
    engine.load_weights(weights)
    engine.seed(1234)
    return engine


class _SwapAt:
    """A refresh that hands new weights at its call-th poll (one poll per chunk), and records the generator's state
    and the tokens so far at that moment."""

    def __init__(self, engine: HFEngine, weights, version: int, call: int):
        self.engine, self.weights, self.version, self.call = engine, weights, version, call
        self.polls = 0
        self.generator_state = None

    def __call__(self):
        self.polls += 1
        if self.polls != self.call:
            return None
        self.generator_state = self.engine.generator.get_state()

        def load() -> int:
            self.engine.load_weights(self.weights)
            return self.version

        return load


def _scored(weights, responses: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log pi (B, R) of responses after PROMPTS (N rows each) under weights: a teacher-forced forward."""
    engine = _engine(weights)
    ids, prompt_mask = left_pad([p for p in PROMPTS for _ in range(N)], PAD)
    return response_log_probs(
        engine.model,
        torch.cat([ids, responses], 1),
        responses.shape[1],
        TEMPERATURE,
        5,
        attention_mask=torch.cat([prompt_mask, mask.long()], 1),
    )


def test_a_response_resumed_across_a_weight_change_keeps_its_prefix_and_scores_each_token_under_its_weights():
    old, new = _weights(0), _weights(1)
    plain = _engine(old).sample(PROMPTS, N, version=3)  # no change: the reference
    engine = _engine(old)
    swap = _SwapAt(engine, new, version=5, call=2)
    samples = engine.sample(PROMPTS, N, version=3, refresh=swap)
    t = 2 * CHUNK  # the second poll: after 8 tokens
    assert swap.polls >= 2
    finished = ~samples.response_mask[:, t - 1] | (samples.responses[:, :t] == EOS).any(1)  # ended by then
    assert 0 < int(finished.sum()) < finished.numel(), "the case needs both finished and unfinished rows at the swap"

    # before the change: the tokens of the run without it; their log-probs the old weights' forward (bitwise) ...
    assert torch.equal(samples.responses[:, :t], plain.responses[:, :t])
    assert torch.equal(samples.response_mask[:, :t], plain.response_mask[:, :t])
    prefix_logp = _scored(old, samples.responses[:, :t], samples.response_mask[:, :t])
    assert torch.equal(samples.behav_logp[:, :t], prefix_logp)
    # ... and those of the run without it up to the forward's length (fp32 rounding where it differs)
    torch.testing.assert_close(samples.behav_logp[:, :t], plain.behav_logp[:, :t], rtol=0, atol=1e-5)
    # finished responses are not touched: the whole row is the reference's
    for row in torch.nonzero(finished).flatten().tolist():
        r = int(plain.response_mask[row].sum())
        assert torch.equal(samples.responses[row, :r], plain.responses[row, :r])
        assert not samples.response_mask[row, r:].any()

    # after it: a teacher-forced forward of the new weights, bitwise, on the unfinished rows' later tokens
    after_logp = _scored(new, samples.responses, samples.response_mask)
    valid_after = samples.response_mask.clone()
    valid_after[:, :t] = False
    assert valid_after.any()
    assert torch.equal(samples.behav_logp[valid_after], after_logp[valid_after])
    assert not torch.allclose(after_logp[:, :t], samples.behav_logp[:, :t])  # the weights did differ

    # the tokens after it: those of a sampler of the new weights started on prompt + the tokens so far, with the
    # generator where the change found it (a wrong KV cache or position id changes them)
    resumed = _engine(new)
    resumed.generator.set_state(swap.generator_state)
    ids, prompt_mask = left_pad([p for p in PROMPTS for _ in range(N)], PAD)
    prefix = torch.cat([ids, samples.responses[:, :t]], 1)
    tail, tail_mask = sample_responses(
        resumed.model,
        prefix,
        NEW_TOKENS - t,
        TEMPERATURE,
        resumed.generator,
        EOS,
        PAD,
        torch.cat([prompt_mask, torch.ones(len(ids), t, dtype=torch.long)], 1),
    )
    for row in torch.nonzero(~finished).flatten().tolist():
        r = int(tail_mask[row].sum())
        assert torch.equal(samples.responses[row, t : t + r], tail[row, :r]), row

    # each token's version: the start's before the change, the new one after it
    assert samples.versions.shape == samples.responses.shape and samples.versions.dtype == torch.long
    assert (samples.versions[:, :t] == 3).all() and (samples.versions[:, t:] == 5).all()
    assert (plain.versions == 3).all()


def test_no_newer_weights_changes_nothing():
    weights = _weights(0)
    plain = _engine(weights).sample(PROMPTS, N, version=2)
    polled = _engine(weights).sample(PROMPTS, N, version=2, refresh=lambda: None)
    for name in ("responses", "response_mask", "behav_logp", "versions"):
        assert torch.equal(getattr(plain, name), getattr(polled, name)), name


def test_a_chunk_of_zero_is_refused_where_weights_may_change():
    engine = _engine(_weights(0))
    with pytest.raises(ValueError, match="chunk must be > 0 where weights may be swapped; got 0"):
        sample_responses(engine.model, torch.tensor([[5, 6]]), 4, 1.0, None, EOS, PAD, chunk=0, swapped=lambda *a: 0)
