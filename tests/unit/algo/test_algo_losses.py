"""Hand-computed checks of agg_loss, policy_loss (clip, dual clip, weights), the bypass losses and the entropy bonus."""

import math
import re

import pytest
import torch

from dppo.algo import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    AlgoInputError,
    LossNormalizers,
    NonFiniteError,
    RolloutCorrectionConfig,
    ShapeMismatchError,
    UnknownNameError,
    agg_loss,
    bypass_policy_loss,
    entropy_bonus,
    get_policy_loss,
    loss_normalizers,
    policy_loss,
)

NAN = float("nan")


def t(rows, dtype=torch.float32):
    return torch.tensor(rows, dtype=dtype)


# ---------------------------------------------------------------------------------------------------
# agg_loss
# ---------------------------------------------------------------------------------------------------

# Row 0 has two valid tokens (1, 2), row 1 one (4), row 2 none; T = 4. Masked positions hold NaN.
AGG_LOSS = t([[1.0, 2.0, NAN, NAN], [4.0, NAN, NAN, NAN], [NAN, NAN, NAN, NAN]])
AGG_MASK = t([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]], torch.bool)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 4) / 3),  # 3 valid tokens
        ("token-sum", 1 + 2 + 4),
        ("seq-mean-token-sum", ((1 + 2) + 4) / 2),  # 2 non-empty sequences
        ("seq-mean-token-mean", ((1 + 2) / 2 + 4 / 1) / 2),  # (1.5 + 4) / 2
        # Regression (verl parity): the seq-mean-token-sum value / T (Dr. GRPO's 1/G sum_i sum_t / T); dppo
        # divided the total sum by T, B times more.
        ("seq-mean-token-sum-norm", ((1 + 2) + 4) / 2 / 4),
    ],
)
def test_agg_loss_modes(mode, expected):
    loss = agg_loss(AGG_LOSS, AGG_MASK, mode)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert loss.item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("mode", list(LOSS_AGG_MODES))
def test_agg_loss_no_valid_token_is_zero_with_zero_grad(mode):
    x = torch.full((2, 3), NAN, requires_grad=True)
    loss = agg_loss(x, torch.zeros(2, 3), mode)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(x.grad, torch.zeros(2, 3))


def test_agg_loss_float_mask_and_bf16_input_give_fp32():
    loss = agg_loss(AGG_LOSS.to(torch.bfloat16), AGG_MASK.float(), "token-mean")
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(7 / 3, rel=1e-6)


# Rows 0-1 and row 2 of AGG_LOSS as two micro-batches: aggregated with the whole batch's normalizers each
# gives its share, and the shares add up to the whole batch's loss in every mode.
@pytest.mark.parametrize("mode", list(LOSS_AGG_MODES))
def test_agg_loss_with_the_whole_batch_normalizers_gives_shares(mode):
    norm = loss_normalizers(AGG_MASK)
    assert (norm.batch_num_tokens.item(), norm.global_batch_size.item(), norm.dp_size) == (3, 2, 1)
    kwargs = dict(batch_num_tokens=norm.batch_num_tokens, global_batch_size=norm.global_batch_size)
    parts = [agg_loss(AGG_LOSS[sl], AGG_MASK[sl], mode, **kwargs) for sl in (slice(0, 1), slice(1, 3))]
    assert sum(p.item() for p in parts) == pytest.approx(agg_loss(AGG_LOSS, AGG_MASK, mode).item(), rel=1e-6)


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(batch_num_tokens=7), 7 / 7),  # token-mean: sum 7 over a global count of 7
        (dict(batch_num_tokens=7, dp_size=2), 2 * 7 / 7),  # ranks average gradients: times dp_size
        (dict(batch_num_tokens=0), 7.0),  # a zero normalizer counts as 1 (no valid token: loss 0)
    ],
)
def test_agg_loss_explicit_normalizers(kwargs, expected):
    assert agg_loss(AGG_LOSS, AGG_MASK, "token-mean", **kwargs).item() == pytest.approx(expected)


def test_agg_loss_scale_factor_replaces_t_in_seq_mean_token_sum_norm():
    loss = agg_loss(AGG_LOSS, AGG_MASK, "seq-mean-token-sum-norm", global_batch_size=4, loss_scale_factor=10)
    assert loss.item() == pytest.approx(7 / 4 / 10)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(dp_size=0), AlgoInputError, "dp_size must be an int >= 1; got 0"),
        (dict(dp_size=2.0), AlgoInputError, "dp_size must be an int >= 1; got 2.0"),
        (dict(batch_num_tokens="3"), TypeError, "batch_num_tokens must be a number, a 0-dim tensor or None; got '3'"),
        (dict(loss_scale_factor=0), AlgoInputError, "loss_scale_factor must be a finite number > 0 or None; got 0"),
        (dict(dp_size=2), AlgoInputError, r"batch_num_tokens \(of the global batch\) is required when dp_size > 1"),
    ],
)
def test_agg_loss_rejects_bad_normalizers(kwargs, error, match):
    with pytest.raises(error, match=match):
        agg_loss(AGG_LOSS, AGG_MASK, "token-mean", **kwargs)
    if "loss_scale_factor" not in kwargs:
        with pytest.raises(error, match=match):
            policy_loss(AGG_LOSS, AGG_LOSS, AGG_LOSS, AGG_MASK, normalizers=LossNormalizers(**kwargs))


def test_agg_loss_errors():
    with pytest.raises(UnknownNameError, match="token-mean.*seq-mean-token-sum-norm"):
        agg_loss(AGG_LOSS, AGG_MASK, "tokenmean")
    with pytest.raises(ShapeMismatchError, match=r"\(3, 3\).*\(3, 4\)"):
        agg_loss(AGG_LOSS[:, :3], AGG_MASK)
    with pytest.raises(NonFiniteError, match=r"loss_mat is not finite: value nan at index \[1, 0\]"):
        agg_loss(AGG_LOSS.clone().index_put_((torch.tensor(1), torch.tensor(0)), torch.tensor(NAN)), AGG_MASK)


# ---------------------------------------------------------------------------------------------------
# policy_loss: one row of tokens chosen to hit every branch of the clipped objective
# ---------------------------------------------------------------------------------------------------
# clip range [1 - 0.2, 1 + 0.28] = [0.8, 1.28] (asymmetric, so swapped bounds change the answer), c = 3.
#  token  r     A    -A r    -A clip(r)   max (PPO)   dual cap -cA   per-token loss   d loss / d log r
#  0      1.5   +1   -1.5    -1.28        -1.28       -            -1.28            0   (clipped)
#  1      0.5   +1   -0.5    -0.8         -0.5        -            -0.5             -A r = -0.5
#  2      0.5   -1   +0.5    +0.8         +0.8        3            0.8              0   (clipped)
#  3      1.5   -1   +1.5    +1.28        +1.5        3            1.5              -A r = +1.5
#  4      5.0   -1   +5.0    +1.28        +5.0        3            3.0              0   (dual clip)
#  5      1.0   +2   -2.0    -2.0         -2.0        -            -2.0             -A r = -2.0
#  6      masked (NaN everywhere)
RATIOS = [1.5, 0.5, 0.5, 1.5, 5.0, 1.0]
ADVS = [1.0, 1.0, -1.0, -1.0, -1.0, 2.0]
TOKEN_LOSSES = [-1.28, -0.5, 0.8, 1.5, 3.0, -2.0]
TOKEN_GRADS = [0.0, -0.5, 0.0, 1.5, 0.0, -2.0]
CLIP = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)


def ppo_inputs(dtype=torch.float32):
    """log_prob (1, 7) requiring grad, old_log_prob, advantages, mask; log r = log RATIOS, token 6 masked."""
    old = t([[-1.0, -2.0, -0.5, -1.5, -3.0, -0.7, NAN]])
    log_prob = old.clone()
    log_prob[0, :6] += torch.tensor([math.log(r) for r in RATIOS])
    log_prob[0, 6] = NAN
    adv = t([ADVS + [NAN]])
    mask = t([[1, 1, 1, 1, 1, 1, 0]])
    return log_prob.to(dtype).requires_grad_(True), old.to(dtype), adv.to(dtype), mask


def test_policy_loss_hand_computed_value_grad_and_metrics():
    log_prob, old, adv, mask = ppo_inputs()
    loss, m = policy_loss(log_prob, old, adv, mask, **CLIP)
    loss.backward()
    assert loss.item() == pytest.approx(sum(TOKEN_LOSSES) / 6, abs=1e-6)  # 1.52 / 6
    # d loss / d log_prob = (d token loss / d log r) / 6 (token-mean over 6 valid tokens); 0 where clipped
    assert torch.allclose(log_prob.grad, t([[g / 6 for g in TOKEN_GRADS] + [0.0]]), atol=1e-6)
    assert m["actor/pg_loss"] == pytest.approx(loss.item())
    assert m["actor/pg_clipfrac"] == pytest.approx(2 / 6)  # tokens 0 and 2
    assert m["actor/pg_clipfrac_lower"] == pytest.approx(1 / 6)  # token 4
    assert m["actor/ppo_kl"] == pytest.approx(-sum(math.log(r) for r in RATIOS) / 6, abs=1e-6)  # mean(old - new)
    assert m["actor/ratio_mean"] == pytest.approx(sum(RATIOS) / 6, rel=1e-6)
    assert m["actor/ratio_max"] == pytest.approx(5.0, rel=1e-6)
    assert m["actor/ratio_min"] == pytest.approx(0.5, rel=1e-6)
    assert all(type(v) is float for v in m.values())


def test_policy_loss_dual_clip_constant_matters():
    # With c = 6 token 4 (r = 5, A = -1) is no longer capped: its loss is 5, not 3, and its gradient is -A r = 5.
    log_prob, old, adv, mask = ppo_inputs()
    loss, m = policy_loss(log_prob, old, adv, mask, **{**CLIP, "clip_ratio_c": 6.0})
    loss.backward()
    assert loss.item() == pytest.approx((sum(TOKEN_LOSSES) - 3.0 + 5.0) / 6, abs=1e-6)
    assert log_prob.grad[0, 4].item() == pytest.approx(5.0 / 6, rel=1e-5)
    assert m["actor/pg_clipfrac_lower"] == 0.0


def test_policy_loss_weights_multiply_tokens_and_keep_the_response_mask_denominator():
    # weights 0 for token 2 (rejected): the denominator stays 6, the count of response_mask.
    weights = t([[1.0, 2.0, 0.0, 0.5, 1.0, 1.0, NAN]])
    log_prob, old, adv, mask = ppo_inputs()
    loss, _ = policy_loss(log_prob, old, adv, mask, weights=weights, **CLIP)
    loss.backward()
    # (-1.28 * 1 + -0.5 * 2 + 0.8 * 0 + 1.5 * 0.5 + 3.0 * 1 + -2.0 * 1) / 6 = -0.53 / 6
    assert loss.item() == pytest.approx(-0.53 / 6, abs=1e-6)
    assert torch.allclose(log_prob.grad, t([[0.0, -0.5 * 2 / 6, 0.0, 1.5 * 0.5 / 6, 0.0, -2.0 / 6, 0.0]]), atol=1e-6)


def test_policy_loss_weights_carry_no_gradient():
    log_prob, old, adv, mask = ppo_inputs()
    weights = torch.ones(1, 7, requires_grad=True)
    loss, _ = policy_loss(log_prob, old, adv, mask, weights=weights, **CLIP)
    loss.backward()
    assert weights.grad is None


@pytest.mark.parametrize(
    "mode, denominator",
    [("token-mean", 6), ("seq-mean-token-sum", 1), ("seq-mean-token-mean", 6), ("seq-mean-token-sum-norm", 7)],
)
def test_policy_loss_agg_modes(mode, denominator):
    # One sequence of 6 valid tokens in T = 7: the token sum 1.52 divided per mode.
    log_prob, old, adv, mask = ppo_inputs()
    loss, _ = policy_loss(log_prob, old, adv, mask, **CLIP, loss_agg_mode=mode)
    assert loss.item() == pytest.approx(sum(TOKEN_LOSSES) / denominator, abs=1e-6)


def test_policy_loss_bf16_inputs_give_fp32_loss():
    log_prob, old, adv, mask = ppo_inputs(torch.bfloat16)
    loss, _ = policy_loss(log_prob, old, adv, mask, **CLIP)
    loss.backward()
    assert loss.dtype == torch.float32 and log_prob.grad.dtype == torch.bfloat16
    assert loss.item() == pytest.approx(sum(TOKEN_LOSSES) / 6, abs=2e-2)


@pytest.mark.parametrize("arg", ["log_prob", "old_log_prob", "advantages", "weights"])
@pytest.mark.parametrize("bad", [NAN, float("inf"), -float("inf")])
def test_policy_loss_rejects_non_finite_at_valid_positions(arg, bad):
    log_prob, old, adv, mask = ppo_inputs()
    inputs = {"log_prob": log_prob.detach().clone(), "old_log_prob": old, "advantages": adv}
    inputs["weights"] = torch.ones(1, 7)
    inputs[arg][0, 3] = bad
    with pytest.raises(NonFiniteError, match=rf"{arg} is not finite: value -?(nan|inf) at index \[0, 3\]"):
        policy_loss(inputs["log_prob"], inputs["old_log_prob"], inputs["advantages"], mask, weights=inputs["weights"])


def test_policy_loss_rejects_negative_weights_and_bad_shapes():
    log_prob, old, adv, mask = ppo_inputs()
    with pytest.raises(AlgoInputError, match=r"weights is negative: value -1.0 at index \[0, 1\]"):
        policy_loss(log_prob, old, adv, mask, weights=t([[1.0, -1.0, 1, 1, 1, 1, 1]]))
    with pytest.raises(ShapeMismatchError, match=r"advantages has shape \(1, 6\) but response_mask has shape \(1, 7\)"):
        policy_loss(log_prob, old, adv[:, :6], mask)
    with pytest.raises(ShapeMismatchError, match=r"weights has shape \(7,\)"):
        policy_loss(log_prob, old, adv, mask, weights=torch.ones(7))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(clip_ratio_low=1.0), "clip_ratio_low must be in \\[0, 1\\)"),
        (dict(clip_ratio_low=-0.1), "clip_ratio_low"),
        (dict(clip_ratio_high=-0.1), "clip_ratio_high must be >= 0"),
        (dict(clip_ratio_c=1.0), "clip_ratio_c .* must be > 1; got 1.0"),
        (dict(clip_ratio_c=float("inf")), "clip_ratio_c must be a finite number"),
        (dict(clip_ratio_high="0.2"), "clip_ratio_high must be a finite number; got '0.2'"),
    ],
)
def test_policy_loss_rejects_bad_clip_settings(kwargs, match):
    log_prob, old, adv, mask = ppo_inputs()
    with pytest.raises(AlgoInputError, match=match):
        policy_loss(log_prob, old, adv, mask, **kwargs)


# ---------------------------------------------------------------------------------------------------
# Bypass mode
# ---------------------------------------------------------------------------------------------------


def test_bypass_ppo_clip_is_policy_loss_against_the_rollout():
    log_prob, rollout, adv, mask = ppo_inputs()
    cfg = RolloutCorrectionConfig(bypass_mode=True, rollout_is="token", rollout_is_threshold=1.1)
    loss, m = bypass_policy_loss(log_prob, rollout, adv, mask, cfg, **CLIP)
    ref, ref_m = policy_loss(log_prob, rollout, adv, mask, **CLIP)
    assert loss.item() == ref.item()  # the IS weights play no part: the ratio pi_theta / pi_behav is the correction
    assert {k: v for k, v in m.items() if k.startswith("actor/")} == ref_m
    # rollout_corr/* describe pi_theta / pi_behav (RATIOS): 1.5, 1.5 and 5 truncated at 1.1
    assert m["rollout_corr/weight_truncated_frac"] == pytest.approx(3 / 6)
    assert m["rollout_corr/kl_k1"] == pytest.approx(-sum(math.log(r) for r in RATIOS) / 6, abs=1e-6)


def test_bypass_ppo_clip_applies_the_rejection_mask():
    # Regression: bypass + ppo_clip + rollout_rs was a ConfigError; verl rejects on pi_theta / pi_behav and
    # drops the rejected tokens from the PPO loss. token_k1 with u = 2.5 keeps 1 / r in [0.4, 2.5]: r = 5 is rejected.
    log_prob, rollout, adv, mask = ppo_inputs()
    cfg = RolloutCorrectionConfig(bypass_mode=True, rollout_rs="token_k1", rollout_rs_threshold=2.5)
    loss, m = bypass_policy_loss(log_prob, rollout, adv, mask, cfg, **CLIP)
    loss.backward()
    kept = [0, 1, 2, 3, 5]  # token 4 (r = 5, the dual-clip token) leaves the loss and its denominator
    assert loss.item() == pytest.approx(sum(TOKEN_LOSSES[i] for i in kept) / 5, abs=1e-6)
    assert torch.allclose(log_prob.grad, t([[TOKEN_GRADS[i] / 5 if i in kept else 0.0 for i in range(6)] + [0.0]]))
    assert m["rollout_corr/token_rejected_frac"] == pytest.approx(1 / 6)
    assert m["actor/pg_clipfrac_lower"] == 0.0 and m["actor/pg_clipfrac"] == pytest.approx(2 / 5)


def reinforce_inputs():
    # pi_theta = (0.5, 0.25, 0.5), pi_behav = (0.25, 0.5, 0.5): w = pi_theta / pi_behav = (2, 0.5, 1); A = (1, -2, 3)
    log_prob = t([[math.log(0.5), math.log(0.25), math.log(0.5), NAN]]).requires_grad_(True)
    rollout = t([[math.log(0.25), math.log(0.5), math.log(0.5), NAN]])
    adv = t([[1.0, -2.0, 3.0, NAN]])
    mask = t([[1, 1, 1, 0]])
    return log_prob, rollout, adv, mask


def test_bypass_reinforce_truncated_weights_hand_computed():
    log_prob, rollout, adv, mask = reinforce_inputs()
    cfg = RolloutCorrectionConfig(bypass_mode=True, loss_type="reinforce", rollout_is="token", rollout_is_threshold=1.5)
    loss, m = bypass_policy_loss(log_prob, rollout, adv, mask, cfg)
    loss.backward()
    w = [1.5, 0.5, 1.0]  # (2, 0.5, 1) truncated at 1.5
    logp = [math.log(0.5), math.log(0.25), math.log(0.5)]
    # loss = mean(-A log pi w) over 3 tokens; gradient d/dlog pi = -A w / 3
    assert loss.item() == pytest.approx(sum(-a * lp * wi for a, lp, wi in zip([1, -2, 3], logp, w)) / 3, rel=1e-6)
    assert torch.allclose(log_prob.grad, t([[-1.5 / 3, 1.0 / 3, -3.0 / 3, 0.0]]), atol=1e-6)
    assert m["rollout_corr/weight_max"] == pytest.approx(1.5, rel=1e-6)
    assert m["rollout_corr/weight_truncated_frac"] == pytest.approx(1 / 3)
    assert m["actor/ratio_max"] == pytest.approx(2.0, rel=1e-6)  # pi_theta / pi_behav before truncation
    assert m["actor/ppo_kl"] == pytest.approx(-(math.log(2) + math.log(0.5) + 0) / 3, abs=1e-6)
    assert m["actor/pg_clipfrac"] == 0.0 and m["actor/pg_clipfrac_lower"] == 0.0


def test_bypass_reinforce_rejected_token_leaves_the_loss_and_the_denominator():
    log_prob, rollout, adv, mask = reinforce_inputs()
    # token_k1 with u = 1.5 keeps 1 / r in [1/1.5, 1.5]: rejects r = 2 and r = 0.5, keeps r = 1
    cfg = RolloutCorrectionConfig(
        bypass_mode=True, loss_type="reinforce", rollout_rs="token_k1", rollout_rs_threshold=1.5
    )
    loss, m = bypass_policy_loss(log_prob, rollout, adv, mask, cfg)
    loss.backward()
    # Regression (verl parity): the mean is over the one kept token; dppo divided by all 3 valid tokens.
    assert loss.item() == pytest.approx(-3.0 * math.log(0.5), rel=1e-6)
    assert torch.allclose(log_prob.grad, t([[0.0, 0.0, -3.0, 0.0]]), atol=1e-6)
    assert m["rollout_corr/token_rejected_frac"] == pytest.approx(2 / 3)
    # pass the batch's pre-rejection counts and the same tokens give the share of a 3-token mean
    loss, _ = bypass_policy_loss(log_prob, rollout, adv, mask, cfg, normalizers=loss_normalizers(mask))
    assert loss.item() == pytest.approx(-3.0 * math.log(0.5) / 3, rel=1e-6)


def test_bypass_reinforce_without_is_is_plain_reinforce():
    log_prob, rollout, adv, mask = reinforce_inputs()
    cfg = RolloutCorrectionConfig(bypass_mode=True, loss_type="reinforce")
    loss, _ = bypass_policy_loss(log_prob, rollout, adv, mask, cfg)
    loss.backward()
    assert torch.allclose(log_prob.grad, t([[-1.0 / 3, 2.0 / 3, -3.0 / 3, 0.0]]), atol=1e-6)


def test_bypass_needs_bypass_mode_and_a_config():
    log_prob, rollout, adv, mask = reinforce_inputs()
    with pytest.raises(ValueError, match="bypass_mode=True"):
        bypass_policy_loss(log_prob, rollout, adv, mask, RolloutCorrectionConfig())
    with pytest.raises(TypeError, match="RolloutCorrectionConfig; got dict"):
        bypass_policy_loss(log_prob, rollout, adv, mask, {"bypass_mode": True})


def test_policy_loss_registry():
    assert set(POLICY_LOSSES) == {"ppo_clip", "reinforce"}
    assert get_policy_loss("reinforce") is POLICY_LOSSES["reinforce"]
    with pytest.raises(UnknownNameError, match="unknown policy loss 'ppo'; valid names: 'ppo_clip', 'reinforce'"):
        get_policy_loss("ppo")
    with pytest.raises(KeyError) as err:  # a failed lookup is also a KeyError, with an unquoted message
        get_policy_loss("ppo")
    assert isinstance(err.value, ValueError) and str(err.value).startswith("unknown policy loss 'ppo'")


# ---------------------------------------------------------------------------------------------------
# Entropy bonus
# ---------------------------------------------------------------------------------------------------


def test_entropy_bonus_sign_value_and_gradient():
    entropy = t([[1.0, 3.0, NAN], [2.0, NAN, NAN]]).requires_grad_(True)
    mask = t([[1, 1, 0], [1, 0, 0]])
    term, m = entropy_bonus(entropy, mask, coef=0.01)
    term.backward()
    assert m == {"actor/entropy": pytest.approx(2.0)}  # (1 + 3 + 2) / 3
    assert term.item() == pytest.approx(-0.02)  # minimizing -coef * H raises H
    assert torch.allclose(entropy.grad, t([[-0.01 / 3, -0.01 / 3, 0.0], [-0.01 / 3, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="coef must be a finite number; got nan"):
        entropy_bonus(entropy, mask, coef=NAN)


# ---------------------------------------------------------------------------------------------------
# Per-token inputs must be (B, T): the seq-mean modes and the sequence-level options read dim -1 as T
# ---------------------------------------------------------------------------------------------------

NOT_2D = [(4,), (2, 2, 2), ()]


def not_2d_match(name, shape):
    return rf"{name} must have shape \(B, T\); got shape {re.escape(str(shape))}"


@pytest.mark.parametrize("shape", NOT_2D)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_policy_loss_rejects_non_2d_inputs(shape, mode):
    # 1-D input with seq-mean-token-mean used to return -1.0, treating the batch as one sequence.
    log_prob, ones = torch.zeros(shape, requires_grad=True), torch.ones(shape)
    with pytest.raises(AlgoInputError, match=not_2d_match("response_mask", shape)):
        policy_loss(log_prob, torch.zeros(shape), ones, ones, loss_agg_mode=mode)


@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
def test_bypass_losses_reject_non_2d_inputs(loss_type):
    cfg = RolloutCorrectionConfig(bypass_mode=True, loss_type=loss_type, rollout_is="sequence")
    log_prob, ones = torch.zeros(4, requires_grad=True), torch.ones(4)
    with pytest.raises(AlgoInputError, match=not_2d_match("response_mask", (4,))):
        bypass_policy_loss(log_prob, torch.zeros(4), ones, ones, cfg)


@pytest.mark.parametrize("shape", NOT_2D)
def test_entropy_bonus_and_agg_loss_reject_non_2d_inputs(shape):
    ones = torch.ones(shape)
    with pytest.raises(AlgoInputError, match=not_2d_match("response_mask", shape)):
        entropy_bonus(ones, ones, coef=0.01, loss_agg_mode="seq-mean-token-mean")
    with pytest.raises(AlgoInputError, match=not_2d_match("loss_mat", shape)):
        agg_loss(ones, ones, "seq-mean-token-mean")
