"""Left padding: a sequence scored or generated inside a padded batch gives what it gives alone (fp32, CPU)."""

import pytest
import torch

from dppo.generation import sample_responses
from dppo.models import forward_logits, response_log_probs
from dppo.rollout import Group, TrainBatch, collate, left_pad

VOCAB = 40
PAD = 0


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    m = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # sharpen the random model so greedy paths are not decided by rounding noise
        m.lm_head.weight.mul_(20)
    return m


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g).numpy() for n in lengths]


def test_log_probs_in_a_padded_batch_equal_those_of_each_sequence_alone(model):
    prompts = _prompts([3, 9, 6, 1])
    g = torch.Generator().manual_seed(1)
    lengths = [5, 2, 5, 4]  # responses right-padded after their end
    responses = [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]
    groups = [Group(torch.from_numpy(p), r[None], torch.ones(1, len(r), dtype=torch.bool), torch.zeros(1, len(r)),
                    torch.zeros(1), 0) for p, r in zip(prompts, responses)]  # fmt: skip
    batch = collate(groups, pad_token=PAD)
    assert batch.input_ids.shape == (4, 9 + 5) and batch.attention_mask is not None
    with torch.no_grad():
        padded = response_log_probs(model, batch.input_ids, 5, 1.0, micro_batch_size=3,
                                    attention_mask=batch.attention_mask)  # fmt: skip
        for i, (p, r) in enumerate(zip(prompts, responses)):
            alone = response_log_probs(model, torch.cat([torch.from_numpy(p), r])[None], len(r), 1.0, 1)
            torch.testing.assert_close(padded[i, : len(r)], alone[0], rtol=0, atol=1e-5)
            assert (batch.input_ids[i, : 9 - len(p)] == PAD).all() and not batch.attention_mask[i, : 9 - len(p)].any()


def test_without_padding_the_mask_is_none_and_scores_are_bitwise_unchanged(model):
    prompts = _prompts([6, 6, 6], seed=2)
    ids, mask = left_pad(prompts, PAD)
    assert mask is None and ids.shape == (3, 6)
    ones = torch.ones_like(ids)
    with torch.no_grad():  # an all-ones mask changes nothing either (same positions, nothing masked)
        torch.testing.assert_close(forward_logits(model, ids, attention_mask=ones), forward_logits(model, ids),
                                   rtol=0, atol=1e-6)  # fmt: skip


def test_greedy_generation_of_a_padded_batch_equals_each_prompt_alone_and_stops_at_eos(model):
    prompts = _prompts([2, 7, 4, 5, 3], seed=3)
    alone = [sample_responses(model, torch.from_numpy(p)[None], 6, 0.0)[0][0] for p in prompts]
    eos = int(alone[1][2])  # a greedy token of the second prompt: that row must stop at its first occurrence
    ids, mask = left_pad(prompts, PAD)
    responses, response_mask = sample_responses(model, ids, 6, 0.0, eos_token=eos, pad_token=PAD, attention_mask=mask)
    for i, reference in enumerate(alone):
        hits = (reference == eos).nonzero()
        end = int(hits[0]) + 1 if len(hits) else 6
        assert torch.equal(responses[i, :end], reference[:end]), i
        assert response_mask[i].tolist() == [True] * end + [False] * (responses.shape[1] - end)
        assert (responses[i, end:] == PAD).all()
    assert response_mask[1].sum() <= 3


def test_every_kv_cache_step_of_a_padded_row_computes_the_logits_of_the_row_alone(model):
    """Each sampling step of a left-padded row (prefill and KV-cache steps) must see the row's own positions: its
    logits equal those of a full forward pass over the row's unpadded tokens (1e-5)."""
    prompts = _prompts([3, 8, 5], seed=4)
    ids, mask = left_pad(prompts, PAD)
    step_logits = []
    handle = model.register_forward_hook(lambda module, args, out: step_logits.append(out.logits[:, -1].detach()))
    responses, response_mask = sample_responses(model, ids, 5, 1.0, torch.Generator().manual_seed(0),
                                                pad_token=PAD, attention_mask=mask)  # fmt: skip
    handle.remove()
    assert len(step_logits) == 5 and response_mask.all()
    for i, prompt in enumerate(prompts):
        alone = torch.cat([torch.from_numpy(prompt), responses[i]])[None]
        with torch.no_grad():
            reference = model(input_ids=alone).logits[0, len(prompt) - 1 : -1]  # (5, V): predicts each response token
        torch.testing.assert_close(torch.stack([s[i] for s in step_logits]), reference, rtol=0, atol=1e-5)


def test_train_batch_rows_keep_groups_and_versions():
    groups = [Group(torch.arange(n) + 1, torch.full((2, 3), n), torch.ones(2, 3, dtype=torch.bool), torch.zeros(2, 3),
                    torch.tensor([n, n + 0.5]), version=10 + n) for n in (2, 4, 3)]  # fmt: skip
    batch = collate(groups)
    part = batch[2:5]  # the second group and the first row of the third
    assert part.num_sequences == 3
    assert part.group_index.tolist() == [0, 0, 1] and part.versions.tolist() == [14, 13]
    assert torch.equal(part.input_ids, batch.input_ids[2:5]) and torch.equal(part.attention_mask, batch.attention_mask[2:5])
    picked = batch.select(torch.tensor([5, 0]))
    assert picked.group_index.tolist() == [1, 0] and picked.versions.tolist() == [12, 13]
    assert picked.scores.tolist() == [3.5, 2.0]
    whole = batch[:]
    for name in TrainBatch.__dataclass_fields__:
        assert torch.equal(getattr(whole, name), getattr(batch, name)), name
