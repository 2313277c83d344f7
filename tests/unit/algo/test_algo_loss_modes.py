"""The loss_mode registry: hand-computed values of each loss, masked garbage, micro-batch shares, the fixed
aggregation of sapo and geo_mean, clip_cov's seeded draw, and the errors."""

import math

import pytest
import torch

from dppo.algo import (
    FIXED_AGG_MODES,
    LOSS_AGG_MODES,
    LOSS_MODES,
    POLICY_LOSS_DEFAULTS,
    AlgoInputError,
    NonFiniteError,
    UnknownNameError,
    get_policy_loss_fn,
    loss_mode_agg_mode,
    loss_normalizers,
    policy_loss,
)

NAN = float("nan")
SETTINGS = {"dro_beta": 0.5, "clip_cov_ratio": 0.5, "clip_cov_lb": -10.0, "clip_cov_ub": 10.0, "kl_cov_ratio": 0.3}


def random_inputs(seed=0, b=6, t=5):
    gen = torch.Generator().manual_seed(seed)
    old = -2.0 * torch.rand(b, t, generator=gen) - 0.05
    log_prob = (old + 0.3 * torch.randn(b, t, generator=gen)).clamp(max=-0.01).requires_grad_(True)
    adv = torch.randn(b, t, generator=gen)
    mask = torch.rand(b, t, generator=gen) > 0.3
    mask[:, 0] = True
    return log_prob, old, adv, mask


def test_registry_names_and_errors():
    assert list(LOSS_MODES) == [
        "vanilla",
        "gspo",
        "sapo",
        "gpg",
        "clip_cov",
        "kl_cov",
        "geo_mean",
        "dro",
        "cispo",
        "dppo_tv",
        "dppo_kl",
    ]
    with pytest.raises(UnknownNameError, match="unknown policy loss_mode 'ppo'; valid names: 'vanilla', 'gspo'"):
        get_policy_loss_fn("ppo")
    log_prob, old, adv, mask = random_inputs()
    with pytest.raises(TypeError, match=r"unknown policy loss config key\(s\) \['clip_ratios'\] for loss_mode 'gspo'"):
        get_policy_loss_fn("gspo")(log_prob, old, adv, mask, clip_ratios=0.2)
    # verl's clip_ratio is a key (the fallback of a null clip_ratio_low / clip_ratio_high), and checked as one
    with pytest.raises(AlgoInputError, match="clip_ratio must be a finite number"):
        get_policy_loss_fn("gspo")(log_prob, old, adv, mask, clip_ratio=float("nan"), clip_ratio_low=None)
    with pytest.raises(AlgoInputError, match="dro_beta must be a number > 0 for loss_mode 'dro'"):
        get_policy_loss_fn("dro")(log_prob, old, adv, mask)
    with pytest.raises(AlgoInputError, match="tau_neg must be > 0; got 0"):
        get_policy_loss_fn("sapo")(log_prob, old, adv, mask, tau_neg=0)
    with pytest.raises(AlgoInputError, match="clip_ratio_low must be in"):
        get_policy_loss_fn("cispo")(log_prob, old, adv, mask, clip_ratio_low=1.0)
    with pytest.raises(UnknownNameError, match="unknown loss_agg_mode 'mean'"):
        get_policy_loss_fn("sapo")(log_prob, old, adv, mask, loss_agg_mode="mean")


def test_vanilla_is_policy_loss_and_ignores_other_keys():
    log_prob, old, adv, mask = random_inputs()
    ours, m = get_policy_loss_fn("vanilla")(log_prob, old, adv, mask, clip_ratio_high=0.3, tau_pos=2.0)
    ref, ref_m = policy_loss(log_prob, old, adv, mask, clip_ratio_high=0.3)
    assert torch.equal(ours, ref) and m == ref_m


def test_defaults_are_verls():
    assert POLICY_LOSS_DEFAULTS == {
        "clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0, "clip_cov_ratio": 0.0002,
        "clip_cov_lb": 1.0, "clip_cov_ub": 5.0, "kl_cov_ratio": 0.0002, "ppo_kl_coef": 0.1, "dro_beta": None,
        "tau_pos": 1.0, "tau_neg": 1.05,
    }  # fmt: skip


def one_token(loss_mode, logp, old, adv, **config):
    """The loss of a single valid token (token-mean) and d loss / d logp."""
    log_prob = torch.tensor([[logp]], requires_grad=True)
    loss, m = get_policy_loss_fn(loss_mode)(
        log_prob,
        torch.tensor([[old]]),
        torch.tensor([[adv]]),
        torch.tensor([[True]]),
        loss_agg_mode="token-mean",
        **config,
    )
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss.item(), grad.item(), m


def test_one_token_values_and_gradients():
    lp, old, a = math.log(0.5), math.log(0.4), 2.0  # r = 1.25
    # cispo: -sg[clip(r, 0.8, 1.2)] A log p -> value -1.2 * 2 * log 0.5, gradient -1.2 * 2
    value, grad, m = one_token("cispo", lp, old, a)
    assert (value, grad) == pytest.approx((-2.4 * lp, -2.4)) and m["actor/pg_clipfrac"] == 1.0
    # gspo on one token: s = r = 1.25 > 1.2 with A > 0 -> clipped, no gradient
    value, grad, m = one_token("gspo", lp, old, a)
    assert (value, grad) == pytest.approx((-2 * 1.2, 0.0)) and m["actor/pg_clipfrac"] == 1.0
    # sapo: -A f(r), f = sigmoid(tau (r - 1)) 4 / tau, tau_pos = 1; df/dlogp = 4 s (1 - s) r
    s = 1 / (1 + math.exp(-0.25))
    value, grad, _ = one_token("sapo", lp, old, a)
    assert (value, grad) == pytest.approx((-2 * 4 * s, -2 * 4 * s * (1 - s) * 1.25))
    # gpg: -A log p
    assert one_token("gpg", lp, old, a)[:2] == pytest.approx((-2 * lp, -2.0))
    # dro: -(A log p - beta / 2 (log r)^2)
    lr = lp - old
    assert one_token("dro", lp, old, a, dro_beta=0.5)[:2] == pytest.approx((-(2 * lp - 0.25 * lr**2), -(2 - 0.5 * lr)))
    # dppo_tv: p - p_old = 0.1 <= 0.2 -> kept: -A min(r, c) log p with c = 3
    assert one_token("dppo_tv", lp, old, a)[:2] == pytest.approx((-2 * 1.25 * lp, -2 * 1.25))
    # ... and dropped once the TV bound is 0.05
    value, grad, m = one_token("dppo_tv", lp, old, a, clip_ratio_high=0.05)
    assert (value, grad, m["actor/pg_clipfrac"]) == (0.0, 0.0, 1.0)
    # geo_mean on one token: log r = 0.223 > 0.2 with A > 0 -> clipped to 0.2
    value, grad, m = one_token("geo_mean", lp, old, a)
    assert (value, grad) == pytest.approx((-2 * math.exp(0.2), 0.0)) and m["actor/pg_clipfrac"] == 1.0
    # kl_cov: the one token has the largest covariance: -A r + coef |log r|
    assert one_token("kl_cov", lp, old, a)[:2] == pytest.approx((-2 * 1.25 + 0.1 * lr, -2 * 1.25 + 0.1))


@pytest.mark.parametrize("loss_mode", list(LOSS_MODES))
def test_masked_garbage_never_leaks(loss_mode):
    log_prob, old, adv, mask = random_inputs(1)
    fn = get_policy_loss_fn(loss_mode)
    clean, m = fn(log_prob, old, adv, mask, generator=torch.Generator().manual_seed(0), **SETTINGS)
    (g_clean,) = torch.autograd.grad(clean, log_prob)
    dirty = [torch.where(mask, x.detach(), NAN) for x in (log_prob, old, adv)]
    dirty[0].requires_grad_(True)
    loss, m2 = fn(*dirty, mask, generator=torch.Generator().manual_seed(0), **SETTINGS)
    (g_dirty,) = torch.autograd.grad(loss, dirty[0])
    assert loss.item() == pytest.approx(clean.item(), rel=1e-6) and m2 == pytest.approx(m, rel=1e-6)
    assert torch.allclose(g_dirty, g_clean) and bool((g_dirty[~mask] == 0).all())


@pytest.mark.parametrize("loss_mode", list(LOSS_MODES))
def test_nan_at_a_valid_token_is_an_error(loss_mode):
    log_prob, old, adv, mask = random_inputs()
    adv = adv.clone()
    adv[0, 0] = NAN
    with pytest.raises(NonFiniteError, match=r"advantages is not finite: value nan at index \[0, 0\]"):
        get_policy_loss_fn(loss_mode)(log_prob, old, adv, mask, **SETTINGS)


@pytest.mark.parametrize("mode", list(LOSS_AGG_MODES))
@pytest.mark.parametrize("loss_mode", [name for name in LOSS_MODES if name not in ("clip_cov", "kl_cov")])
def test_micro_batches_add_up_to_the_whole_batch(loss_mode, mode):
    """With the whole batch's normalizers the micro-batches' losses add up to the one-pass loss (clip_cov and
    kl_cov select tokens per batch given, so they add up only when the selection does)."""
    log_prob, old, adv, mask = random_inputs(2, b=7)
    mask[3] = False  # a sequence without valid tokens
    fn = get_policy_loss_fn(loss_mode)
    whole, _ = fn(log_prob, old, adv, mask, loss_agg_mode=mode, **SETTINGS)
    norm = loss_normalizers(mask)
    parts = [
        fn(
            log_prob[s : s + 3],
            old[s : s + 3],
            adv[s : s + 3],
            mask[s : s + 3],
            loss_agg_mode=mode,
            normalizers=norm,
            **SETTINGS,
        )[0]
        for s in range(0, 7, 3)
    ]
    assert sum(parts).item() == pytest.approx(whole.item(), rel=1e-5, abs=1e-7)


def test_sapo_and_geo_mean_aggregate_their_own_way():
    log_prob, old, adv, mask = random_inputs(3)
    for loss_mode, fixed in FIXED_AGG_MODES.items():
        fn = get_policy_loss_fn(loss_mode)
        values = {fn(log_prob, old, adv, mask, loss_agg_mode=mode)[0].item() for mode in LOSS_AGG_MODES}
        assert len(values) == 1, loss_mode
        assert loss_mode_agg_mode(loss_mode, "token-sum") == fixed
    assert loss_mode_agg_mode("gspo", "token-sum") == "token-sum"


def test_geo_mean_averages_over_sequences_with_a_valid_token():
    """verl's torch.mean would count the empty row; dppo's divides by the 2 sequences that have tokens, so
    padding rows and wholly rejected sequences do not shrink the loss."""
    log_prob, old, adv, mask = random_inputs(4, b=2)
    fn = get_policy_loss_fn("geo_mean")
    loss, _ = fn(log_prob, old, adv, mask)
    padded = [torch.cat([x.detach(), torch.zeros(1, x.shape[1])]) for x in (log_prob, old, adv)]
    loss2, _ = fn(*padded, torch.cat([mask, torch.zeros(1, mask.shape[1], dtype=torch.bool)]))
    assert loss2.item() == pytest.approx(loss.item(), rel=1e-6)


def test_geo_mean_uses_the_geometric_mean_of_the_weights():
    log_prob, old, adv, mask = random_inputs(5, b=1)
    weights = torch.full(mask.shape, 0.5)
    fn = get_policy_loss_fn("geo_mean")
    assert fn(log_prob, old, adv, mask, weights=weights)[0].item() == pytest.approx(
        0.5 * fn(log_prob, old, adv, mask)[0].item(), rel=1e-5
    )


def test_clip_cov_draw_follows_the_generator():
    log_prob, old, adv, mask = random_inputs(6, b=16, t=16)
    fn = get_policy_loss_fn("clip_cov")
    cfg = {"clip_cov_ratio": 0.05, "clip_cov_lb": -10.0, "clip_cov_ub": 10.0}

    def cut(seed):
        loss, m = fn(log_prob, old, adv, mask, generator=torch.Generator().manual_seed(seed), **cfg)
        (grad,) = torch.autograd.grad(loss, log_prob)
        return (grad == 0) & mask, m["actor/pg_clipfrac"]

    (a, frac), (b, _), (c, _) = cut(1), cut(1), cut(2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert frac == pytest.approx(int(0.05 * int(mask.sum())) / int(mask.sum()))
