"""rollout.partial_rollout's per-token versions in a batch: built by collate (a group without them: its version
everywhere), kept by select, carried through the replay buffer's array form and a checkpoint's group state, and what
the trainer's metrics make of them."""

import pytest
import torch

from dppo.batch import Group, collate, token_version_metrics
from dppo.trainer.state import group_from_state, group_state


def _group(prompt_len: int, versions: list[list[int]] | None, version: int, lengths: list[int]) -> Group:
    n, width = len(lengths), max(lengths)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]  # (n, R)
    return Group(
        prompt=torch.arange(1, prompt_len + 1),
        responses=torch.where(mask, 7, 0),
        response_mask=mask,
        behav_logp=torch.where(mask, -1.0, 0.0),
        scores=torch.zeros(n),
        version=version,
        token_versions=None if versions is None else torch.tensor(versions),
    )


GROUPS = [
    _group(3, [[4, 4, 5, 5], [4, 4, 0, 0]], 4, [4, 2]),  # one response resumed under version 5, one ended before
    _group(2, None, 3, [3, 1]),  # no per-token versions: version 3 everywhere (an old checkpoint, an old engine)
    _group(3, [[2, 3, 3, 4], [2, 2, 2, 3]], 2, [4, 4]),  # two versions changed mid-response
]


def test_collate_builds_per_token_versions_and_select_keeps_them():
    batch = collate(GROUPS, 0)
    mask = batch.response_mask
    want = torch.tensor([[4, 4, 5, 5], [4, 4, 4, 4], [3, 3, 3, 3], [3, 3, 3, 3], [2, 3, 3, 4], [2, 2, 2, 3]])
    # padding holds the group's (start) version; compare the valid tokens and the whole shape
    assert batch.token_versions.shape == mask.shape and batch.token_versions.dtype == torch.long
    assert torch.equal(batch.token_versions[mask], want[mask])
    assert torch.equal(batch.behav_versions(), batch.token_versions)
    part = batch.select(torch.tensor([4, 0]))
    assert torch.equal(part.token_versions, batch.token_versions[[4, 0]])
    assert torch.equal(batch[2:4].token_versions, batch.token_versions[2:4])
    # a batch without them: every token its group's version
    batch.token_versions = None
    assert torch.equal(batch.behav_versions(), batch.versions[batch.group_index][:, None].expand(-1, 4))


def test_equal_shapes_stack_the_per_token_versions_too():
    groups = [GROUPS[2], _group(3, None, 6, [4, 4])]  # one prompt length, one response length: no padding
    batch = collate(groups, 0)
    assert batch.attention_mask is None
    assert torch.equal(batch.token_versions, torch.tensor([[2, 3, 3, 4], [2, 2, 2, 3], [6] * 4, [6] * 4]))


def test_the_replay_buffers_arrays_and_a_checkpoints_state_keep_them():
    group = GROUPS[0]
    for back in (Group.from_arrays(group.to_arrays()), group_from_state(group_state(group))):
        assert torch.equal(back.token_versions, group.token_versions) and back.version == 4
    assert Group.from_arrays(GROUPS[1].to_arrays()).token_versions is None
    old = group_state(GROUPS[1])
    del old["token_versions"]  # a checkpoint written before partial rollouts
    assert group_from_state(old).token_versions is None


def test_token_metrics_count_each_tokens_own_version():
    batch = collate(GROUPS, 0)
    metrics = token_version_metrics(batch, version=6)
    # valid tokens' versions: 4 4 5 5 | 4 4 | 3 3 3 | 3 | 2 3 3 4 | 2 2 2 3 -> staleness 6 - v
    stale = [2, 2, 1, 1, 2, 2, 3, 3, 3, 3, 4, 3, 3, 2, 4, 4, 4, 3]
    assert metrics["staleness/token_mean"] == pytest.approx(sum(stale) / len(stale))
    assert metrics["staleness/token_max"] == 4.0
    # versions per response: 2, 1, 1, 1, 3, 2
    assert metrics["rollout/partial_frac"] == pytest.approx(3 / 6)
    assert metrics["rollout/versions_per_response"] == pytest.approx(10 / 6)
