"""Left padding: a sequence scored or generated inside a padded batch gives what it gives alone (fp32, CPU)."""

import pytest
import torch

from dppo.generation import sample_responses
from dppo.algo import log_probs_from_logits
from dppo.models import forward_logits, forward_response_logits, position_ids_from_mask, response_log_probs
from dppo.batch import Group, TrainBatch, collate, left_pad

VOCAB = 40
PAD = 0


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM  # rotary: depends on relative positions only

    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        )
    )


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel  # learned absolute position embeddings (wpe)

    return GPT2LMHeadModel(
        GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, tie_word_embeddings=False)
    )


def _opt():
    from transformers import OPTConfig, OPTForCausalLM  # learned absolute position embeddings (offset by 2)

    return OPTForCausalLM(
        OPTConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
            pad_token_id=PAD,
            tie_word_embeddings=False,
        )
    )


ARCHITECTURES = {"qwen2": _qwen2, "gpt2": _gpt2, "opt": _opt}


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def model(request):
    """A tiny random causal LM of each architecture: with rotary positions a wrong position id moves the logits by
    rounding only; with learned absolute ones (GPT-2, OPT) it changes them outright."""
    torch.manual_seed(0)
    m = ARCHITECTURES[request.param]().eval()
    with torch.no_grad():  # sharpen the random model so greedy paths are not decided by rounding noise
        m.get_output_embeddings().weight.mul_(20)
    return m


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g).numpy() for n in lengths]


def test_log_probs_in_a_padded_batch_equal_those_of_each_sequence_alone(model):
    prompts = _prompts([3, 9, 6, 1])
    g = torch.Generator().manual_seed(1)
    lengths = [5, 2, 5, 4]  # responses right-padded after their end
    responses = [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]
    groups = [
        Group(
            torch.from_numpy(p),
            r[None],
            torch.ones(1, len(r), dtype=torch.bool),
            torch.zeros(1, len(r)),
            torch.zeros(1),
            0,
        )
        for p, r in zip(prompts, responses)
    ]
    batch = collate(groups, pad_token=PAD)
    assert batch.input_ids.shape == (4, 9 + 5) and batch.attention_mask is not None
    with torch.no_grad():
        padded = response_log_probs(
            model, batch.input_ids, 5, 1.0, micro_batch_size=3, attention_mask=batch.attention_mask
        )
        for i, (p, r) in enumerate(zip(prompts, responses)):
            alone = response_log_probs(model, torch.cat([torch.from_numpy(p), r])[None], len(r), 1.0, 1)
            torch.testing.assert_close(padded[i, : len(r)], alone[0], rtol=0, atol=1e-5)
            assert (batch.input_ids[i, : 9 - len(p)] == PAD).all() and not batch.attention_mask[i, : 9 - len(p)].any()


def _padded_rows(model, seed=5):
    """A left-padded batch of 4 prompts (lengths 3, 9, 6, 1) with right-padded responses: (batch, its rows)."""
    prompts = _prompts([3, 9, 6, 1], seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    responses = [torch.randint(1, VOCAB, (n,), generator=g) for n in [5, 2, 5, 4]]
    groups = [
        Group(
            torch.from_numpy(p),
            r[None],
            torch.ones(1, len(r), dtype=torch.bool),
            torch.zeros(1, len(r)),
            torch.zeros(1),
            0,
        )
        for p, r in zip(prompts, responses)
    ]
    rows = [torch.cat([torch.from_numpy(p), r])[None] for p, r in zip(prompts, responses)]
    return collate(groups, pad_token=PAD), rows, responses


def test_old_and_training_log_probs_and_gradients_of_a_padded_batch_equal_each_row_alone(model):
    """The old log-probs (functional_call over other weights, as a snapshot read does) and the training forward's
    (with grad) of each left-padded row equal the row's alone, and so does the gradient they give."""
    batch, rows, responses = _padded_rows(model)
    R = batch.response_length
    params = {name: p.detach().clone() for name, p in model.named_parameters()}  # pi_old's weights, held elsewhere
    with torch.no_grad():
        old = response_log_probs(model, batch.input_ids, R, 1.0, 3, params, batch.attention_mask)  # (4, R)
    labels = batch.input_ids[:, -R:]
    logits = forward_response_logits(model, batch.input_ids, R, None, batch.attention_mask)  # (4, R, V)
    logp = log_probs_from_logits(logits, labels, 1.0)  # (4, R) the training forward's
    model.zero_grad()
    logp[batch.response_mask].sum().backward()
    padded_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    for i, (row, response) in enumerate(zip(rows, responses)):
        alone = log_probs_from_logits(forward_response_logits(model, row, len(response)), response[None], 1.0)
        alone.sum().backward()  # accumulates: the sum over the rows alone
        torch.testing.assert_close(old[i, : len(response)], alone[0].detach(), rtol=0, atol=1e-5)
        torch.testing.assert_close(logp[i, : len(response)].detach(), alone[0].detach(), rtol=0, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(padded_grads[name], p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    model.zero_grad(set_to_none=True)


def test_position_ids_count_each_rows_own_tokens_from_its_first_real_one():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1], [0, 1, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0], [0, 0, 1, 2, 3]]
    bool_mask = mask.bool()  # a bool mask counts alike (collate's masks are long)
    assert torch.equal(position_ids_from_mask(bool_mask), position_ids_from_mask(mask))
    assert position_ids_from_mask(bool_mask).dtype == torch.long


def test_without_padding_the_mask_is_none_and_scores_are_bitwise_unchanged(model):
    prompts = _prompts([6, 6, 6], seed=2)
    ids, mask = left_pad(prompts, PAD)
    assert mask is None and ids.shape == (3, 6)
    ones = torch.ones_like(ids)
    with torch.no_grad():  # an all-ones mask changes nothing either (same positions, nothing masked)
        torch.testing.assert_close(
            forward_logits(model, ids, attention_mask=ones), forward_logits(model, ids), rtol=0, atol=1e-6
        )


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
    responses, response_mask = sample_responses(
        model, ids, 5, 1.0, torch.Generator().manual_seed(0), pad_token=PAD, attention_mask=mask
    )
    handle.remove()
    assert len(step_logits) == 5 and response_mask.all()
    for i, prompt in enumerate(prompts):
        alone = torch.cat([torch.from_numpy(prompt), responses[i]])[None]
        with torch.no_grad():
            reference = model(input_ids=alone).logits[0, len(prompt) - 1 : -1]  # (5, V): predicts each response token
        torch.testing.assert_close(torch.stack([s[i] for s in step_logits]), reference, rtol=0, atol=1e-5)


def test_train_batch_rows_keep_groups_and_versions():
    groups = [
        Group(
            torch.arange(n) + 1,
            torch.full((2, 3), n),
            torch.ones(2, 3, dtype=torch.bool),
            torch.zeros(2, 3),
            torch.tensor([n, n + 0.5]),
            version=10 + n,
        )
        for n in (2, 4, 3)
    ]
    batch = collate(groups)
    part = batch[2:5]  # the second group and the first row of the third
    assert part.num_sequences == 3
    assert part.group_index.tolist() == [0, 0, 1] and part.versions.tolist() == [14, 13]
    assert torch.equal(part.input_ids, batch.input_ids[2:5]) and torch.equal(
        part.attention_mask, batch.attention_mask[2:5]
    )
    picked = batch.select(torch.tensor([5, 0]))
    assert picked.group_index.tolist() == [1, 0] and picked.versions.tolist() == [12, 13]
    assert picked.scores.tolist() == [3.5, 2.0]
    whole = batch[:]
    for name in TrainBatch.__dataclass_fields__:
        got, expected = getattr(whole, name), getattr(batch, name)
        assert (got is None and expected is None) or torch.equal(got, expected), name  # reward_baselines: None
