"""verl 0.9.1's advantage estimators and KL names through dppo's registries against verl's own functions on
random inputs; and the REINFORCE bypass ppo_kl beyond the +-20 clamp."""

import numpy as np
import pytest
import torch

from dppo.algo import (
    ADVANTAGE_ESTIMATORS,
    KL_PENALTIES,
    get_advantage_estimator,
    kl_loss,
    kl_penalty,
    reinforce_bypass_loss,
)

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
pytestmark = pytest.mark.oracle

SEEDS = range(3)


def group_batch(seed, sizes=(1, 4, 2, 3, 1, 4), t=6):
    """Scores (B,) with repeats and zeros, group ids (members not adjacent), a ragged mask with holes where every
    row has a valid token, and verl's token-level rewards: the score at the row's last valid token."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    ids = ids[torch.randperm(len(ids), generator=gen)]
    scores = (2 * torch.rand(len(ids), generator=gen) - 0.5).round(decimals=1)
    mask = torch.rand(len(ids), t, generator=gen) > 0.3
    mask[:, 0] = True
    last = t - 1 - mask.flip(-1).int().argmax(-1)  # (B,)
    rewards = torch.zeros(mask.shape)
    rewards[torch.arange(len(ids)), last] = scores
    return scores, ids, mask, rewards


def verl_estimator(name, rewards, mask, ids, gamma, norm, baselines):
    from verl.trainer.config import AlgoConfig

    index = np.array([f"uid-{i}" for i in ids.tolist()], dtype=object)
    config = AlgoConfig(gamma=gamma, norm_adv_by_std_in_grpo=norm, adv_estimator=name)
    fn = core_algos.get_adv_estimator_fn(name)
    kwargs = dict(token_level_rewards=rewards.clone(), response_mask=mask.float(), index=index, config=config)
    if name == "grpo":
        kwargs["norm_adv_by_std_in_grpo"] = norm
    if name == "remax":
        kwargs["reward_baselines"] = baselines
    return fn(**kwargs)[0]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma, norm", [(1.0, True), (0.9, False)], ids=["gamma1-std", "gamma0.9-nostd"])
@pytest.mark.parametrize("name", list(ADVANTAGE_ESTIMATORS))
def test_estimators_match_verl(seed, name, gamma, norm):
    sizes = (2, 4, 2, 3, 2, 4) if name == "grpo_passk" else (1, 4, 2, 3, 1, 4)  # pass@k needs groups of 2+
    scores, ids, mask, rewards = group_batch(seed, sizes)
    baselines = torch.rand(len(scores), generator=torch.Generator().manual_seed(7 + seed))
    config = dict(gamma=gamma, norm_adv_by_std_in_grpo=norm)
    if name == "remax":
        config["reward_baselines"] = baselines
    ours = get_advantage_estimator(name)(scores, ids, mask, **config)
    theirs = verl_estimator(name, rewards, mask, ids, gamma, norm, baselines) * mask  # 0 at masked tokens
    assert ours.shape == mask.shape and ours.dtype == torch.float32
    # advantages that cancel to ~0 differ in the rounding of the group mean: 1e-6 absolute on top of 1e-5 relative
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", list(KL_PENALTIES))
def test_kl_names_value_and_gradient_match_verl(batch, seed, kind):
    ref, _, mask = batch(seed)
    gen = torch.Generator().manual_seed(50 + seed)
    log_prob = (ref + 0.5 * torch.randn(ref.shape, generator=gen) + torch.where(mask, 0.0, 25.0)).requires_grad_(True)
    ours = kl_penalty(log_prob, ref, kind)
    theirs = core_algos.kl_penalty(log_prob, ref, kind)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=0.0)
    (g_ours,) = torch.autograd.grad(ours.sum(), log_prob)
    (g_theirs,) = torch.autograd.grad(theirs.sum(), log_prob)
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-5, atol=0.0)


@pytest.mark.parametrize("kind", ["k3+", "low_var_kl+", "abs"])
def test_kl_loss_with_loss_scale_factor_matches_verl(batch, kind):
    ref, _, mask = batch(0)
    log_prob = (ref + 0.3 * torch.randn(ref.shape, generator=torch.Generator().manual_seed(3))).requires_grad_(True)
    term, m = kl_loss(log_prob, ref, mask, 0.1, kind, "seq-mean-token-sum-norm", loss_scale_factor=9)
    theirs = core_algos.agg_loss(
        core_algos.kl_penalty(log_prob, ref, kind), mask.float(), "seq-mean-token-sum-norm", loss_scale_factor=9
    )
    torch.testing.assert_close(term, 0.1 * theirs, rtol=1e-5, atol=0.0)
    assert m["actor/kl_loss"] == pytest.approx(theirs.item(), rel=1e-5)


def test_reinforce_bypass_ppo_kl_is_unclamped_as_verl(batch, verl_actor_config):
    """Log-ratios of +-30 nats: verl's REINFORCE ppo_kl takes them as they are (dppo clamped at +-20)."""
    rollout, _, mask = batch(0)
    log_prob = (rollout + 30.0 + torch.rand(rollout.shape, generator=torch.Generator().manual_seed(1))).requires_grad_()
    adv = torch.randn(rollout.shape, generator=torch.Generator().manual_seed(2))
    _, m = reinforce_bypass_loss(log_prob, rollout, adv, mask)
    _, v_m = core_algos.compute_policy_loss_reinforce(
        rollout, log_prob, adv, mask.float(), "token-mean", verl_actor_config("token-mean")
    )
    assert m["actor/ppo_kl"] == pytest.approx(v_m["actor/ppo_kl"], rel=1e-5)
    assert m["actor/ppo_kl"] < -30.0  # clamped, it was -20
