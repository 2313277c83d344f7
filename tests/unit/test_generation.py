"""The KV-cached sampler against a plain full-recompute reference."""

import pytest
import torch

from dppo.generation import sample_responses
from dppo.models import build_model, forward_logits, response_log_probs
from dppo.config import ModelConfig

VOCAB = 12


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = build_model(
        ModelConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64), VOCAB, seed=3
    )
    with torch.no_grad():  # sharpen the random model so greedy paths are not decided by rounding noise
        m.lm_head.weight.mul_(20)
    return m


@torch.no_grad()
def greedy_reference(model, prompts, steps):
    seq = prompts
    for _ in range(steps):
        nxt = model(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    return seq[:, prompts.shape[1] :]


def test_greedy_matches_full_recompute(model):
    prompts = torch.randint(0, VOCAB, (16, 6), generator=torch.Generator().manual_seed(1))
    responses, mask = sample_responses(model, prompts, 5, temperature=0.0)
    assert torch.equal(responses, greedy_reference(model, prompts, 5))
    assert mask.all()


def test_the_prefill_runs_the_lm_head_on_the_last_prompt_position_only(model):
    prompts = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(8))
    seen = []
    handle = model.lm_head.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    responses, _ = sample_responses(model, prompts, 3, temperature=0.0)
    handle.remove()
    assert seen == [(4, 1, 32)] * 3  # the prefill and two single-token steps: never the 6 prompt positions
    assert torch.equal(responses, greedy_reference(model, prompts, 3))


def test_eos_ends_a_response_and_pads_after_it(model):
    prompts = torch.randint(0, VOCAB, (32, 6), generator=torch.Generator().manual_seed(2))
    reference = greedy_reference(model, prompts, 6)
    eos = int(reference[0, 1])  # the second greedy token of the first prompt: row 0 must stop there
    responses, mask = sample_responses(model, prompts, 6, temperature=0.0, eos_token=eos, pad_token=0)
    for row in range(32):
        hits = (reference[row] == eos).nonzero()
        end = int(hits[0]) + 1 if len(hits) else 6
        assert mask[row].tolist() == [True] * end + [False] * (6 - end)
        assert torch.equal(responses[row, :end], reference[row, :end])
        assert (responses[row, end:] == 0).all()
    assert mask[0].sum() == 2


def test_sampling_is_reproducible_and_follows_softmax_over_temperature(model):
    prompts = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3)).expand(8000, -1)
    temperature = 2.5
    a, _ = sample_responses(model, prompts, 1, temperature, torch.Generator().manual_seed(7))
    b, _ = sample_responses(model, prompts, 1, temperature, torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=prompts[:1]).logits[0, -1] / temperature, -1)
    freq = torch.bincount(a[:, 0], minlength=VOCAB).float() / a.shape[0]
    assert torch.allclose(freq, probs, atol=0.02), (freq, probs)


def test_response_log_probs_micro_batching_is_exact(model):
    ids = torch.randint(0, VOCAB, (13, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        whole = response_log_probs(model, ids, 4, 1.3, micro_batch_size=13)
        parts = response_log_probs(model, ids, 4, 1.3, micro_batch_size=5)
        logits = model(input_ids=ids).logits[:, 4:-1].float() / 1.3
    reference = torch.log_softmax(logits, -1).gather(-1, ids[:, 5:, None]).squeeze(-1)
    assert whole.shape == (13, 4)
    torch.testing.assert_close(whole, reference, rtol=0, atol=1e-5)
    torch.testing.assert_close(parts, whole, rtol=0, atol=1e-6)


def test_only_the_response_positions_go_through_the_lm_head(model):
    ids = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(5))
    seen = []
    handle = model.lm_head.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    with torch.no_grad():
        logp = response_log_probs(model, ids, 4, 1.0, micro_batch_size=3)
    handle.remove()
    assert seen == [(3, 5, 32)]  # R + 1 = 5 positions, not P + R = 9
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, 4:-1]
    reference = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 5:, None]).squeeze(-1)
    torch.testing.assert_close(logp, reference, rtol=0, atol=1e-5)


class _NoLogitsToKeep(torch.nn.Module):
    """A causal LM whose forward has no logits_to_keep argument."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB)

    def forward(self, input_ids, use_cache=False):
        return type("Out", (), {"logits": self.head(self.embed(input_ids).cumsum(1))})()


def test_logits_to_keep_slices_the_logits_of_a_model_that_does_not_take_it():
    model = _NoLogitsToKeep()
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        kept = forward_logits(model, ids, logits_to_keep=3)
        assert torch.equal(kept, forward_logits(model, ids)[:, -3:])
