"""dppo's losses, aggregation, KL estimators and advantages against verl 0.9.1's core_algos, on random inputs:
values and gradients to 1e-5 relative; and the whole Decoupled pipeline (IS weights x rejection mask -> PPO loss,
entropy bonus and KL penalty over the kept tokens), in one pass and micro-batched with global normalizers."""

import numpy as np
import pytest
import torch

from dppo.algo import (
    LOSS_AGG_MODES,
    RolloutCorrectionConfig,
    agg_loss,
    bypass_policy_loss,
    compute_rollout_correction_and_rejection_mask,
    entropy_bonus,
    grpo_advantages,
    kl_loss,
    kl_penalty,
    loss_normalizers,
    policy_loss,
    rloo_advantages,
)

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
verl_rc = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
pytestmark = pytest.mark.oracle

SEEDS = range(3)
MODES = list(LOSS_AGG_MODES)
CLIP = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)


def close(actual, expected, what=""):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=0.0, msg=lambda m: f"{what}: {m}")


def grad_of(loss, leaf):
    (grad,) = torch.autograd.grad(loss, leaf)
    return grad


def policy_inputs(batch, seed):
    """old / rollout log-probs, mask, and log_prob (a leaf), advantages, weights in [0, 2]."""
    old, rollout, mask = batch(seed)
    gen = torch.Generator().manual_seed(1000 + seed)
    log_prob = (old + 0.3 * torch.randn(old.shape, generator=gen)).requires_grad_(True)
    adv = torch.randn(old.shape, generator=gen)
    weights = 2 * torch.rand(old.shape, generator=gen)
    return old, rollout, mask, log_prob, adv, weights


# ---------------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_matches_verl(batch, seed, mode):
    _, loss_mat, mask = batch(seed)
    close(agg_loss(loss_mat, mask, mode), core_algos.agg_loss(loss_mat, mask.float(), mode), mode)


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_with_global_normalizers_matches_verl(batch, mode):
    _, loss_mat, mask = batch(0)
    globals_ = dict(batch_num_tokens=97, global_batch_size=13, dp_size=2, loss_scale_factor=40)
    theirs = core_algos.agg_loss(loss_mat, mask.float(), mode, **globals_)
    close(agg_loss(loss_mat, mask, mode, **globals_), theirs, mode)


# ---------------------------------------------------------------------------------------------------
# The vanilla PPO loss (Decoupled PPO's policy loss) in every aggregation mode, with weights
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_ppo_loss_value_gradient_and_metrics_match_verl(batch, verl_actor_config, seed, mode, weighted):
    old, _, mask, log_prob, adv, weights = policy_inputs(batch, seed)
    w = weights if weighted else None
    loss, m = policy_loss(log_prob, old, adv, mask, weights=w, loss_agg_mode=mode, **CLIP)
    v_loss, v_m = core_algos.compute_policy_loss_vanilla(
        old, log_prob, adv, mask.float(), mode, verl_actor_config(mode, **CLIP), w
    )
    close(loss, v_loss, "loss")
    close(grad_of(loss, log_prob), grad_of(v_loss, log_prob), "gradient")
    for key in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        assert m[key] == pytest.approx(v_m[key], rel=1e-5, abs=1e-7), key


# ---------------------------------------------------------------------------------------------------
# Bypass mode: the correction on pi_theta / pi_behav, its rejection mask applied to either loss
# ---------------------------------------------------------------------------------------------------

BYPASS_SETTINGS = [
    dict(),
    dict(rollout_is="token", rollout_is_threshold=1.5),
    dict(rollout_is="sequence", rollout_is_threshold="0.2_5", rollout_is_batch_normalize=True),
    dict(rollout_rs="token_k1", rollout_rs_threshold="0.8_1.5"),
    dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1,seq_max_k2",
         rollout_rs_threshold="0.6_1.3,0.3"),
]  # fmt: skip


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("settings", BYPASS_SETTINGS, ids=repr)
@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
def test_bypass_loss_matches_verl(batch, verl_actor_config, seed, settings, loss_type):
    _, rollout, mask, log_prob, adv, _ = policy_inputs(batch, seed)
    mode = "seq-mean-token-mean" if loss_type == "reinforce" else "token-mean"
    settings = dict(bypass_mode=True, loss_type=loss_type, **settings)
    loss, m = bypass_policy_loss(
        log_prob, rollout, adv, mask, RolloutCorrectionConfig(**settings), loss_agg_mode=mode, **CLIP
    )
    config = verl_actor_config(mode, rollout_correction=settings, **CLIP)
    v_loss, v_m = core_algos.compute_policy_loss_bypass_mode(rollout, log_prob, adv, mask.float(), mode, config)
    close(loss, v_loss, "loss")
    close(grad_of(loss, log_prob), grad_of(v_loss, log_prob), "gradient")
    assert m["actor/ppo_kl"] == pytest.approx(v_m["actor/ppo_kl"], rel=1e-5, abs=1e-7)


# ---------------------------------------------------------------------------------------------------
# Advantages and KL estimators
# ---------------------------------------------------------------------------------------------------


def group_batch(seed):
    """Scores (B,), group ids with groups of 1 to 4 members (uid strings for verl), and a mask."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [1, 4, 2, 3, 1, 4]
    ids = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    ids = ids[torch.randperm(len(ids), generator=gen)]  # members of a group need not be adjacent
    scores = torch.rand(len(ids), generator=gen).round(decimals=1)  # repeated values, as rewards have
    mask = torch.rand(len(ids), 5, generator=gen) > 0.3
    return scores, ids, mask


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("estimator", ["grpo", "grpo-no-std", "rloo"])
def test_advantages_match_verl(seed, estimator):
    scores, ids, mask = group_batch(seed)
    rewards = torch.zeros(mask.shape)
    rewards[:, 0] = scores  # verl sums the token-level rewards: the outcome score
    index = np.array([f"uid-{i}" for i in ids.tolist()], dtype=object)
    if estimator == "rloo":
        ours = rloo_advantages(scores, ids, mask)
        theirs, _ = core_algos.get_adv_estimator_fn("rloo")(rewards, mask.float(), index)
    else:
        norm = estimator == "grpo"
        ours = grpo_advantages(scores, ids, mask, norm_by_std=norm)
        theirs, _ = core_algos.get_adv_estimator_fn("grpo")(rewards, mask.float(), index, norm_adv_by_std_in_grpo=norm)
    # advantages that cancel to ~0 differ in the rounding of the group mean: 1e-6 absolute on top of 1e-5 relative
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", ["k1", "kl", "k2", "mse", "k3", "low_var_kl"])
def test_kl_penalty_value_and_gradient_match_verl(batch, seed, kind):
    ref, _, mask, log_prob, _, _ = policy_inputs(batch, seed)
    log_prob = (log_prob.detach() + torch.where(mask, 0.0, 25.0)).requires_grad_(True)  # also log r beyond +-20
    ours = kl_penalty(log_prob, ref, kind)
    theirs = core_algos.kl_penalty(log_prob, ref, kind)
    close(ours, theirs, kind)
    close(grad_of(ours.sum(), log_prob), grad_of(theirs.sum(), log_prob), kind)


# ---------------------------------------------------------------------------------------------------
# The whole Decoupled pipeline: correction -> PPO loss + entropy bonus + KL penalty over the kept tokens
# ---------------------------------------------------------------------------------------------------

PIPELINE = dict(
    rollout_is="token",
    rollout_is_threshold=2.0,
    rollout_is_batch_normalize=True,
    rollout_rs="token_k1,seq_mean_k3",
    rollout_rs_threshold="0.6_1.5,0.1",
)
COEF = dict(entropy=0.01, kl=0.1)


def dppo_pipeline(old, rollout, mask, log_prob, adv, entropy, ref, mode, micro):
    """dppo's loss, summed over micro-batches of `micro` sequences aggregated with the whole batch's normalizers."""
    config = RolloutCorrectionConfig(**PIPELINE)
    weights, keep, _ = compute_rollout_correction_and_rejection_mask(old, rollout, mask, config)
    norm = loss_normalizers(keep)
    total = 0.0
    for start in range(0, old.shape[0], micro):
        sl = slice(start, start + micro)
        pg, _ = policy_loss(
            log_prob[sl], old[sl], adv[sl], keep[sl], weights=weights[sl], loss_agg_mode=mode, normalizers=norm, **CLIP
        )
        bonus, _ = entropy_bonus(entropy[sl], keep[sl], COEF["entropy"], mode, norm)
        kl, _ = kl_loss(log_prob[sl], ref[sl], keep[sl], COEF["kl"], "low_var_kl", mode, norm)
        total = total + pg + bonus + kl
    return total


def verl_pipeline(old, rollout, mask, log_prob, adv, entropy, ref, mode, micro, make_config):
    """verl's: the correction on the batch, then its ppo_loss terms per micro-batch with global_batch_info."""
    proto, vmask, _ = verl_rc.compute_rollout_correction_and_rejection_mask(old, rollout, mask.float(), **PIPELINE)
    weights = proto.batch["rollout_is_weights"]
    info = dict(dp_size=1, batch_num_tokens=int(vmask.sum()), global_batch_size=int((vmask.sum(-1) > 0).sum()))
    config = make_config(mode, global_batch_info=info, **CLIP)
    total = 0.0
    for start in range(0, old.shape[0], micro):
        sl = slice(start, start + micro)
        pg, _ = core_algos.compute_policy_loss_vanilla(
            old[sl], log_prob[sl], adv[sl], vmask[sl], mode, config, weights[sl]
        )
        ent = core_algos.agg_loss(entropy[sl], vmask[sl], mode, **info)
        kld = core_algos.kl_penalty(log_prob[sl], ref[sl], "low_var_kl")
        total = total + pg - COEF["entropy"] * ent + COEF["kl"] * core_algos.agg_loss(kld, vmask[sl], mode, **info)
    return total


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("micro", [8, 3], ids=["whole", "micro3"])
@pytest.mark.parametrize("mode", MODES)
def test_decoupled_pipeline_matches_verl(batch, verl_actor_config, seed, mode, micro):
    old, rollout, mask, log_prob, _, _ = policy_inputs(batch, seed)
    scores = torch.rand(old.shape[0], generator=torch.Generator().manual_seed(seed))
    adv = grpo_advantages(scores, torch.arange(old.shape[0]) // 4, mask)
    gen = torch.Generator().manual_seed(2000 + seed)
    entropy = (2 * torch.rand(old.shape, generator=gen)).requires_grad_(True)
    ref = old + 0.2 * torch.randn(old.shape, generator=gen)
    inputs = (old, rollout, mask, log_prob, adv, entropy, ref, mode, micro)
    ours, theirs = dppo_pipeline(*inputs), verl_pipeline(*inputs, verl_actor_config)
    close(ours, theirs, "loss")
    for leaf in (log_prob, entropy):
        close(grad_of(ours, leaf), grad_of(theirs, leaf), "gradient")
    if micro < old.shape[0]:  # the micro-batches add up to the one-pass loss
        close(ours, dppo_pipeline(*inputs[:-1], old.shape[0]), "micro-batched vs one pass")
