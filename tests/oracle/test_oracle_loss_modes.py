"""Every policy loss_mode of dppo.algo.get_policy_loss_fn against verl 0.9.1's registered function of the same name,
on random inputs: the loss and its gradient to 1e-5 relative and the metrics verl reports, in every
loss_agg_mode, with and without IS weights, one pass and micro-batched with the whole batch's normalizers."""

import pytest
import torch

from dppo.algo import LOSS_AGG_MODES, LOSS_MODES, get_policy_loss_fn, loss_normalizers

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
pytestmark = pytest.mark.oracle

SEEDS = range(2)
MODES = list(LOSS_AGG_MODES)
NEW_LOSSES = [name for name in LOSS_MODES if name != "vanilla"]

# Settings that make every branch of each loss fire on 8 x 12 random tokens (verl's defaults cut or penalize
# a single token there); each loss reads its own keys and ignores the rest, in dppo as in verl.
SETTINGS = dict(
    clip_ratio_low=0.2,
    clip_ratio_high=0.28,
    clip_ratio_c=3.0,
    clip_cov_ratio=0.2,
    clip_cov_lb=0.05,
    clip_cov_ub=4.0,
    kl_cov_ratio=0.2,
    ppo_kl_coef=0.5,
    dro_beta=0.3,
    tau_pos=1.0,
    tau_neg=1.05,
)
POLICY_LOSS_KEYS = ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef", "dro_beta")


def verl_config(loss_mode, loss_agg_mode, settings, global_batch_info=None):
    """verl's ActorConfig carrying settings, as verl's trainer builds it."""
    from verl.workers.config import ActorConfig, PolicyLossConfig

    policy_loss = PolicyLossConfig(loss_mode=loss_mode, **{k: settings[k] for k in POLICY_LOSS_KEYS if k in settings})
    actor = {k: v for k, v in settings.items() if k not in POLICY_LOSS_KEYS}
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        loss_agg_mode=loss_agg_mode,
        policy_loss=policy_loss,
        global_batch_info=dict(global_batch_info or {}),
        **actor,
    )


def close(actual, expected, what=""):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-7, msg=lambda m: f"{what}: {m}")


def grad_of(loss, leaf):
    (grad,) = torch.autograd.grad(loss, leaf)
    return grad


def inputs(batch, seed, loss_mode):
    """pi_prox, mask, log_prob (a leaf), advantages, weights; every row has a valid token for geo_mean (whose
    mean over sequences verl takes over all rows, dppo over rows with a valid token)."""
    old, _, mask = batch(seed)
    if loss_mode == "geo_mean":
        mask[1, :3] = True
    gen = torch.Generator().manual_seed(1000 + seed)
    log_prob = (old + 0.3 * torch.randn(old.shape, generator=gen)).clamp(max=-1e-3).requires_grad_(True)
    adv = torch.randn(old.shape, generator=gen)
    weights = 2 * torch.rand(old.shape, generator=gen)
    return old, mask, log_prob, adv, weights


def verl_loss(loss_mode, old, log_prob, adv, mask, mode, settings, weights, seed, info=None):
    torch.manual_seed(seed)  # clip_cov draws with torch's global generator
    fn = core_algos.get_policy_loss_fn(loss_mode)
    return fn(old, log_prob, adv, mask.float(), mode, verl_config(loss_mode, mode, settings, info), weights)


def dppo_loss(loss_mode, old, log_prob, adv, mask, mode, settings, weights, seed, normalizers=None):
    gen = torch.Generator().manual_seed(seed)
    fn = get_policy_loss_fn(loss_mode)
    return fn(
        log_prob,
        old,
        adv,
        mask,
        weights=weights,
        loss_agg_mode=mode,
        normalizers=normalizers,
        generator=gen,
        **settings,
    )


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss_mode", NEW_LOSSES)
def test_loss_value_gradient_and_metrics_match_verl(batch, loss_mode, mode, weighted, seed):
    old, mask, log_prob, adv, weights = inputs(batch, seed, loss_mode)
    w = weights if weighted else None
    loss, m = dppo_loss(loss_mode, old, log_prob, adv, mask, mode, SETTINGS, w, seed)
    v_loss, v_m = verl_loss(loss_mode, old, log_prob, adv, mask, mode, SETTINGS, w, seed)
    close(loss, v_loss, "loss")
    close(grad_of(loss, log_prob), grad_of(v_loss, log_prob), "gradient")
    assert m["actor/pg_loss"] == pytest.approx(loss.item())
    for key, value in v_m.items():
        assert m[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("loss_mode", NEW_LOSSES)
def test_verl_defaults_match_verl(batch, loss_mode):
    """No config key given: dppo's defaults are verl's (dro has none: its beta is required in both)."""
    old, mask, log_prob, adv, _ = inputs(batch, 0, loss_mode)
    settings = {"dro_beta": 0.1} if loss_mode == "dro" else {}
    loss, m = dppo_loss(loss_mode, old, log_prob, adv, mask, "token-mean", settings, None, 0)
    v_loss, v_m = verl_loss(loss_mode, old, log_prob, adv, mask, "token-mean", settings, None, 0)
    close(loss, v_loss, "loss")
    close(grad_of(loss, log_prob), grad_of(v_loss, log_prob), "gradient")
    for key, value in v_m.items():
        assert m[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("loss_mode", ["gspo", "cispo", "sapo", "dppo_tv", "dppo_kl"])
def test_large_log_ratio_gaps_match_verl(batch, loss_mode):
    """+-30 nat gaps between pi_theta and pi_prox: the clamps sit where verl's do."""
    old, mask, log_prob, adv, weights = inputs(batch, 1, loss_mode)
    gap = 30.0 * torch.sign(torch.randn(old.shape, generator=torch.Generator().manual_seed(5)))
    log_prob = (old + gap).clamp(max=-1e-3).detach().requires_grad_(True)
    loss, _ = dppo_loss(loss_mode, old, log_prob, adv, mask, "token-mean", SETTINGS, weights, 0)
    v_loss, _ = verl_loss(loss_mode, old, log_prob, adv, mask, "token-mean", SETTINGS, weights, 0)
    close(loss, v_loss, "loss")
    close(grad_of(loss, log_prob), grad_of(v_loss, log_prob), "gradient")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss_mode", [name for name in NEW_LOSSES if name != "geo_mean"])
def test_micro_batches_with_global_normalizers_match_verl(batch, loss_mode, mode):
    """Micro-batches of 3 aggregated with the whole batch's normalizers (and a loss_scale_factor): verl with the
    same global_batch_info, micro-batch for micro-batch (clip_cov draws with the same seed in each)."""
    old, mask, log_prob, adv, weights = inputs(batch, 0, loss_mode)
    norm = loss_normalizers(mask)
    info = dict(
        dp_size=1,
        batch_num_tokens=int(norm.batch_num_tokens),
        global_batch_size=int(norm.global_batch_size),
        loss_scale_factor=7,
    )
    ours = theirs = 0.0
    for start in range(0, old.shape[0], 3):
        sl = slice(start, start + 3)
        args = (old[sl], log_prob[sl], adv[sl], mask[sl], mode, SETTINGS, weights[sl], start)
        loss, _ = get_policy_loss_fn(loss_mode)(
            log_prob[sl],
            old[sl],
            adv[sl],
            mask[sl],
            weights=weights[sl],
            loss_agg_mode=mode,
            normalizers=norm,
            loss_scale_factor=7,
            generator=torch.Generator().manual_seed(start),
            **SETTINGS,
        )
        ours = ours + loss
        theirs = theirs + verl_loss(loss_mode, *args, info=info)[0]
    close(ours, theirs, "loss")
    close(grad_of(ours, log_prob), grad_of(theirs, log_prob), "gradient")


# verl's clip_ratio: the clip where clip_ratio_low / clip_ratio_high are null (None), ignored where they are set.
CLIP_CASES = {
    "both_set": dict(clip_ratio=0.1, clip_ratio_low=0.2, clip_ratio_high=0.28),
    "low_null": dict(clip_ratio=0.15, clip_ratio_low=None, clip_ratio_high=0.28),
    "high_null": dict(clip_ratio=0.15, clip_ratio_low=0.2, clip_ratio_high=None),
    "both_null": dict(clip_ratio=0.15, clip_ratio_low=None, clip_ratio_high=None),
}


@pytest.mark.parametrize("case", list(CLIP_CASES))
@pytest.mark.parametrize("loss_mode", list(LOSS_MODES))
def test_clip_ratio_is_the_fallback_of_null_clip_ratio_low_and_high_as_in_verl(batch, loss_mode, case):
    settings = {**SETTINGS, **CLIP_CASES[case]}
    old, mask, log_prob, adv, weights = inputs(batch, 0, loss_mode)
    loss, m = dppo_loss(loss_mode, old, log_prob, adv, mask, "token-mean", settings, weights, 0)
    v_loss, v_m = verl_loss(loss_mode, old, log_prob, adv, mask, "token-mean", settings, weights, 0)
    close(loss, v_loss, "loss")
    close(grad_of(loss, log_prob), grad_of(v_loss, log_prob), "gradient")
    for key, value in v_m.items():
        assert m[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
