"""Hand-computed GRPO and RLOO advantages, group handling and input errors."""

import math

import pytest
import torch

from dppo.algo import (
    ADVANTAGE_ESTIMATORS,
    NonFiniteError,
    ShapeMismatchError,
    UnknownNameError,
    get_advantage_estimator,
    grpo_advantages,
    rloo_advantages,
)

# Group 0: scores (1, 0, 1); groups 1 and 2 hold one sequence each.
SCORES = torch.tensor([1.0, 0.0, 1.0, 0.5, 2.0])
GROUPS = torch.tensor([0, 0, 0, 1, 2])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]])


def per_seq(adv, mask=MASK):
    """The value broadcast on each sequence's valid tokens; checks it is constant there and 0 elsewhere."""
    mask = mask.bool()
    assert adv.dtype == torch.float32 and adv.shape == mask.shape
    assert torch.all(adv[~mask] == 0)
    first = adv[:, 0]
    assert torch.all(torch.where(mask, adv, first[:, None]) == first[:, None])
    return first.tolist()


def test_grpo_hand_computed():
    # group 0: mean 2/3; deviations (1/3, -2/3, 1/3); unbiased var = (1/9 + 4/9 + 1/9) / 2 = 1/3; std = 0.57735
    std = math.sqrt(1 / 3)
    adv = grpo_advantages(SCORES, GROUPS, MASK)
    # the singleton group 1 has mean 0 and std 1 (verl's convention): 0.5 / (1 + eps)
    expected = [(1 / 3) / (std + 1e-6), (-2 / 3) / (std + 1e-6), (1 / 3) / (std + 1e-6), 0.5 / (1 + 1e-6)]
    assert per_seq(adv)[:4] == pytest.approx(expected, rel=1e-6)
    assert adv[4].abs().sum() == 0  # empty response row: all masked


def test_grpo_matches_torch_std_and_eps():
    adv = grpo_advantages(SCORES, GROUPS, torch.ones(5, 1), eps=0.1)
    g = SCORES[:3]
    assert adv[:3, 0].tolist() == pytest.approx(((g - g.mean()) / (g.std() + 0.1)).tolist(), rel=1e-6)


def test_grpo_without_std_normalization():
    adv = grpo_advantages(SCORES, GROUPS, MASK, norm_by_std=False)
    assert per_seq(adv) == pytest.approx([1 / 3, -2 / 3, 1 / 3, 0.5, 0.0], abs=1e-7)  # row 4 is all masked


def test_rloo_hand_computed():
    # group 0: 1 - mean(0, 1) = 0.5; 0 - mean(1, 1) = -1; 1 - mean(1, 0) = 0.5; singletons keep their score
    adv = rloo_advantages(SCORES, GROUPS, torch.ones(5, 2))
    assert per_seq(adv, torch.ones(5, 2)) == pytest.approx([0.5, -1.0, 0.5, 0.5, 2.0], abs=1e-7)


@pytest.mark.parametrize("estimator", [grpo_advantages, rloo_advantages])
def test_identical_scores_give_zero(estimator):
    adv = estimator(torch.tensor([3.0, 3.0, 3.0, 0.25, 0.25]), torch.tensor([5, 5, 5, 9, 9]), torch.ones(5, 2))
    assert torch.allclose(adv, torch.zeros(5, 2), atol=1e-6)


@pytest.mark.parametrize("estimator, expected", [(grpo_advantages, 7.0 / (1 + 1e-6)), (rloo_advantages, 7.0)])
def test_a_group_of_one_keeps_its_score(estimator, expected):
    # Regression (verl parity): verl gives a group of one mean 0 (and std 1), so its advantage is its score
    # (GRPO: over 1 + eps); dppo gave 0, so rollout.n=1 never learned.
    adv = estimator(torch.tensor([3.0, 3.0, 7.0]), torch.tensor([5, 5, 9]), torch.ones(3, 2))
    assert adv[2].tolist() == pytest.approx([expected, expected], rel=1e-7)
    assert torch.allclose(adv[:2], torch.zeros(2, 2))


@pytest.mark.parametrize("estimator", [grpo_advantages, rloo_advantages])
def test_group_ids_may_be_any_ints_or_hashables_in_any_order(estimator):
    scores = torch.tensor([1.0, 4.0, 0.0, 2.0])
    ref = estimator(scores[[0, 2, 1, 3]], torch.tensor([0, 0, 1, 1]), torch.ones(4, 1))[[0, 2, 1, 3]]
    assert torch.equal(estimator(scores, torch.tensor([-7, 30, -7, 30]), torch.ones(4, 1)), ref)
    assert torch.equal(estimator(scores, ["uid-a", "uid-b", "uid-a", "uid-b"], torch.ones(4, 1)), ref)


def test_bf16_scores_and_float_mask_give_fp32():
    adv = grpo_advantages(SCORES.bfloat16(), GROUPS.int(), MASK.float())
    assert adv.dtype == torch.float32


def test_registry():
    # The registry takes verl's key names: grpo's norm_adv_by_std_in_grpo and epsilon are norm_by_std and eps.
    grpo, rloo = get_advantage_estimator("grpo"), get_advantage_estimator("rloo")
    assert torch.equal(grpo(SCORES, GROUPS, MASK), grpo_advantages(SCORES, GROUPS, MASK))
    assert torch.equal(
        grpo(SCORES, GROUPS, MASK, norm_adv_by_std_in_grpo=False, epsilon=0.5, gamma=0.9),
        grpo_advantages(SCORES, GROUPS, MASK, norm_by_std=False, eps=0.5),
    )
    assert torch.equal(rloo(SCORES, GROUPS, MASK, epsilon=0.5), rloo_advantages(SCORES, GROUPS, MASK))
    assert list(ADVANTAGE_ESTIMATORS) == [
        "grpo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "opo",
        "grpo_passk",
        "gpg",
        "remax",
    ]
    with pytest.raises(UnknownNameError, match="unknown advantage estimator 'gae'; valid names: 'grpo', 'rloo', "):
        get_advantage_estimator("gae")
    with pytest.raises(TypeError, match=r"unknown advantage estimator config key\(s\) \['norm_by_std'\] for 'grpo'"):
        grpo(SCORES, GROUPS, MASK, norm_by_std=False)
    with pytest.raises(TypeError, match="advantage estimator 'remax' needs reward_baselines"):
        get_advantage_estimator("remax")(SCORES, GROUPS, MASK)


def test_input_errors():
    with pytest.raises(NonFiniteError, match=r"scores is not finite: value nan at index 1"):
        grpo_advantages(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]), torch.ones(2, 3))
    with pytest.raises(ShapeMismatchError, match=r"group_index has shape \(3,\) but scores has shape \(2,\)"):
        grpo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0, 1]), torch.ones(2, 3))
    with pytest.raises(ShapeMismatchError, match=r"response_mask has shape \(3, 3\) but scores has shape \(2,\)"):
        rloo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.ones(3, 3))
    with pytest.raises(ShapeMismatchError, match=r"scores must have shape \(B,\); got shape \(2, 1\)"):
        rloo_advantages(torch.ones(2, 1), torch.tensor([0, 0]), torch.ones(2, 3))
    with pytest.raises(TypeError, match="group_index must be an integer tensor; got dtype torch.float32"):
        grpo_advantages(torch.ones(2), torch.zeros(2), torch.ones(2, 3))
    for eps in (0.0, -1e-6, float("nan")):
        with pytest.raises(ValueError, match="eps must be finite and > 0"):
            grpo_advantages(torch.ones(2), torch.zeros(2, dtype=torch.long), torch.ones(2, 3), eps=eps)
