"""A multi-turn agent's response has tokens between its turns that the loss skips (mask 0) but the model reads: the
batch's attention mask covers them, and a left-padded row's log-probs equal those of the row alone."""

import torch

from dppo.batch import Group, attended, collate
from dppo.models import response_log_probs, tiny_model_config, model_from_config


def _group(prompt: list[int], responses: list[list[int]], masks: list[list[int]]) -> Group:
    width = max(len(r) for r in responses)
    ids = torch.zeros((len(responses), width), dtype=torch.long)
    mask = torch.zeros((len(responses), width), dtype=torch.bool)
    for i, (r, m) in enumerate(zip(responses, masks)):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.bool)
    n = len(responses)
    return Group(torch.tensor(prompt), ids, mask, torch.zeros(ids.shape), torch.zeros(n), 0)


def test_tokens_between_turns_are_attended_up_to_the_last_loss_token():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 0], [1, 0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    want = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(attended(mask), want)


def test_a_padded_multi_turn_row_scores_as_it_does_alone():
    model = model_from_config(tiny_model_config(32, 32, 2, 2, 64), "float32").eval()
    # turn 1 (3 sampled), a tool's 2 tokens (masked), turn 2 (2 sampled); the other group's prompt is longer
    agent = _group([5, 6], [[7, 8, 3, 20, 21, 9, 3]], [[1, 1, 1, 0, 0, 1, 1]])
    other = _group([5, 6, 7, 8, 9], [[10, 11, 3]], [[1, 1, 1]])
    batch = collate([agent, other], pad_token=0)
    assert batch.attention_mask is not None
    assert batch.attention_mask[0].tolist() == [0, 0, 0, 1, 1] + [1] * 7  # the tool's tokens are read
    with torch.no_grad():
        padded = response_log_probs(model, batch.input_ids, 7, 1.0, 2, attention_mask=batch.attention_mask)[0]
        alone = response_log_probs(model, torch.tensor([[5, 6, 7, 8, 3, 20, 21, 9, 3]]), 7, 1.0, 1)[0]
    torch.testing.assert_close(padded, alone, rtol=0, atol=1e-5)
