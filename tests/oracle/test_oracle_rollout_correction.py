"""dppo's rollout correction against verl 0.9.1's compute_rollout_correction_and_rejection_mask, on random inputs:
rejection masks bit for bit, IS weights to 1e-5 relative, and the same thresholds accepted and refused."""

import math

import pytest
import torch

from dppo.algo import (
    RolloutCorrectionConfig,
    RolloutCorrectionConfigError,
    compute_rollout_correction_and_rejection_mask,
)

verl_rc = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
pytestmark = pytest.mark.oracle

SEEDS = range(4)


def verl_correction(old, rollout, mask, **settings):
    """verl's (weights or None, modified mask as bool) for dppo-style settings."""
    proto, modified, _ = verl_rc.compute_rollout_correction_and_rejection_mask(
        old, rollout, mask.float(), **{"rollout_is": None, **settings}
    )
    weights = None if proto is None else proto.batch["rollout_is_weights"]
    return weights, modified.bool()


def dppo_correction(old, rollout, mask, **settings):
    config = RolloutCorrectionConfig(**settings)
    weights, keep, _ = compute_rollout_correction_and_rejection_mask(old, rollout, mask, config)
    return weights, keep


def assert_same(old, rollout, mask, **settings):
    """Both give the same rejection mask (exactly) and the same weights (1e-5 relative); returns verl's mask."""
    v_w, v_mask = verl_correction(old, rollout, mask, **settings)
    d_w, d_mask = dppo_correction(old, rollout, mask, **settings)
    assert torch.equal(d_mask, v_mask), settings
    assert (d_w is None) == (v_w is None), settings
    if v_w is not None:
        torch.testing.assert_close(d_w, v_w, rtol=1e-5, atol=0.0, msg=lambda m: f"{settings}: {m}")
    return v_mask


# ---------------------------------------------------------------------------------------------------
# Rejection masks: every option, asymmetric k1 bands, chains
# ---------------------------------------------------------------------------------------------------

# (rollout_rs, rollout_rs_threshold) chosen so that on random_batch some tokens are kept and some rejected.
RS_CASES = [
    ("token_k1", 1.5),
    ("token_k1", "0.5_1.5"),  # asymmetric: verl keeps pi_behav / pi_prox in the band, not its inverse
    ("token_k1", "0.8_2.0"),
    ("token_k2", 0.05),
    ("token_k3", 0.05),
    ("seq_sum_k1", "0.3_1.5"),
    ("seq_sum_k2", 0.6),
    ("seq_sum_k3", 0.6),
    ("seq_mean_k1", "0.8_1.4"),
    ("seq_mean_k2", 0.1),
    ("seq_mean_k3", 0.1),
    ("seq_max_k2", 0.3),
    ("seq_max_k3", 0.3),
    ("token_k1,seq_max_k2", "0.6_1.3,0.5"),
    ("seq_sum_k1,token_k3,seq_mean_k2", "0.2_3,0.2,0.15"),
    ("token_k1,seq_mean_k1", 2.0),  # one threshold for every option
    ("token_k1,token_k1", "0.7_1.2"),  # a repeated option counts once
    ("token_k2,", "0.05,"),  # an empty entry is dropped
]


def test_every_option_has_a_case():
    tested = {o.strip() for options, _ in RS_CASES for o in options.split(",") if o.strip()}
    assert tested == set(verl_rc.SUPPORTED_ROLLOUT_RS_OPTIONS)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("rollout_rs, threshold", RS_CASES)
def test_rejection_mask_matches_verl(batch, seed, rollout_rs, threshold):
    old, rollout, mask = batch(seed)
    kept = assert_same(old, rollout, mask, rollout_rs=rollout_rs, rollout_rs_threshold=threshold)
    assert 0 < kept.sum() < mask.sum(), "the case should keep some tokens and reject others"


@pytest.mark.parametrize("seed", SEEDS)
def test_asymmetric_k1_band_on_log_ratios_at_the_bounds(seed):
    # log r placed exactly on log(lo), log(hi) and their negatives: the inclusive bounds decide the same way.
    lo, hi = 0.5, 1.5
    gen = torch.Generator().manual_seed(seed)
    edges = torch.tensor([math.log(lo), math.log(hi), -math.log(lo), -math.log(hi), 0.0, 2.0, -2.0])
    log_r = edges[torch.randint(0, len(edges), (6, 9), generator=gen)]  # old_log_prob; rollout_log_prob = 0
    mask = torch.rand(6, 9, generator=gen) > 0.2
    mask[0, 0] = True
    for option in ("token_k1", "seq_sum_k1", "seq_mean_k1"):
        assert_same(log_r, torch.zeros_like(log_r), mask, rollout_rs=option, rollout_rs_threshold=f"{lo}_{hi}")


# ---------------------------------------------------------------------------------------------------
# IS weights: token / sequence, truncation and bands, batch normalization, with and without rejection
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("threshold", [2.0, 0.8, "0.5_2.0", "0.3_1.5"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_is_weights_match_verl(batch, seed, level, threshold, normalize):
    old, rollout, mask = batch(seed, spread=0.3 if level == "sequence" else 0.5)
    assert_same(
        old, rollout, mask, rollout_is=level, rollout_is_threshold=threshold, rollout_is_batch_normalize=normalize
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_sequence_weights_clamp_the_summed_log_ratio(seed):
    # Large per-token ratios whose sum is moderate, and sums beyond +-20: verl clamps the sum, not each token.
    gen = torch.Generator().manual_seed(seed)
    log_r = 25.0 * torch.randn(5, 4, generator=gen)
    rollout = -torch.rand(5, 4, generator=gen)
    mask = torch.ones(5, 4, dtype=torch.bool)
    assert_same(rollout + log_r, rollout, mask, rollout_is="sequence", rollout_is_threshold=1e9)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_weights_and_rejection_together_match_verl(batch, seed, level):
    old, rollout, mask = batch(seed)
    assert_same(
        old,
        rollout,
        mask,
        rollout_is=level,
        rollout_is_threshold="0.2_5",
        rollout_is_batch_normalize=True,
        rollout_rs="token_k1,seq_max_k3",
        rollout_rs_threshold="0.6_1.6,0.4",
    )


# ---------------------------------------------------------------------------------------------------
# Thresholds: the same specifications accepted and refused
# ---------------------------------------------------------------------------------------------------


def verl_accepts(**settings) -> bool:
    old, rollout, mask = torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3)
    try:
        verl_rc.compute_rollout_correction_and_rejection_mask(old, rollout, mask, **settings)
    except (ValueError, TypeError, ZeroDivisionError):
        return False
    return True


def dppo_accepts(**settings) -> bool:
    try:
        RolloutCorrectionConfig(**settings)
    except RolloutCorrectionConfigError:
        return False
    return True


IS_THRESHOLDS = [
    2.0,
    2,
    "2",
    " 3.5 ",
    0.5,
    "0.5_2.0",
    " 0.5_2 ",
    "1_1",
    "1e-1_1e1",  # accepted
    0,
    -1.0,
    "0",
    "",
    "  ",
    "abc",
    "2_0.5",
    "0_2",
    "_2",
    "2_",
    "a_2",
    True,
    False,
    [2.0],
]  # refused
RS_THRESHOLDS = [
    # accepted
    ("token_k1", 2.0), ("token_k1", "2"), ("token_k1", 1), ("token_k1", "0.5_1.5"), ("token_k2", 0.5),
    ("token_k2", "0.5"), ("token_k1,token_k2", "2"), ("token_k1,token_k2", "2,0.5"), ("token_k1,", "2,"),
    ("token_k1,token_k1", 2.0), (" seq_sum_k1 , seq_sum_k3 ", " 1.5 , 0.2 "), ("seq_max_k3", "1e-3"),
    # refused
    ("token_k1", 0.5), ("token_k1", "1.5_0.5"), ("token_k1", 0), ("token_k1", "0_2"), ("token_k1", "_2"),
    ("token_k1", ""), ("token_k1", " , "), ("token_k1", None), ("token_k1", True), ("token_k1", [2.0]),
    ("token_k2", "0.5_2"), ("token_k2", 0), ("token_k2", -1), ("token_k2", "abc"),
    ("token_k1,token_k2", "2,3,4"), ("token_k1,token_k1", "2,3"), ("token_k4", 2.0), ("seq_max_k1", 2.0),
    ("", 2.0), (",", 2.0),
]  # fmt: skip


@pytest.mark.parametrize("threshold", IS_THRESHOLDS, ids=repr)
def test_is_threshold_accepted_and_refused_alike(threshold):
    settings = dict(rollout_is="token", rollout_is_threshold=threshold)
    assert dppo_accepts(**settings) == verl_accepts(**settings)


@pytest.mark.parametrize("rollout_rs, threshold", RS_THRESHOLDS, ids=repr)
def test_rs_threshold_accepted_and_refused_alike(rollout_rs, threshold):
    settings = dict(rollout_rs=rollout_rs, rollout_rs_threshold=threshold)
    accepted = verl_accepts(**settings)
    assert dppo_accepts(**settings) == accepted
    if accepted:  # and read alike
        old, rollout, mask = torch.randn(4, 5), torch.randn(4, 5), torch.ones(4, 5, dtype=torch.bool)
        assert_same(old, rollout, mask, **settings)


# What verl lets through to nonsense and dppo refuses on purpose (rollout_correction_config's docstring).
DELIBERATE_DIFFERENCES = [
    dict(rollout_rs="token_k2", rollout_rs_threshold="nan"),  # verl rejects every token
    dict(rollout_rs="token_k1", rollout_rs_threshold="nan"),  # verl rejects every token
    dict(rollout_rs="token_k2", rollout_rs_threshold="inf"),
    dict(rollout_rs="token_k1", rollout_rs_threshold="0.5_1_0"),  # verl: "1_0" is 10, the band [0.5, 10]
    dict(rollout_is="token", rollout_is_threshold=float("nan")),  # verl: nan weights
    dict(rollout_is="token", rollout_is_threshold="inf"),
    dict(rollout_is="token", rollout_is_threshold=None),  # verl silently applies no weights
    dict(rollout_is=None, rollout_is_threshold="abc"),  # verl never reads it
]


@pytest.mark.parametrize("settings", DELIBERATE_DIFFERENCES, ids=repr)
def test_dppo_refuses_what_verl_lets_through(settings):
    assert verl_accepts(**settings) and not dppo_accepts(**settings)
