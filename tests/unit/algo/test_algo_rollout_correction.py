"""RolloutCorrectionConfig validation, the threshold parser, and hand-computed weights and rejection masks for
every IS and RS mode (tests/oracle checks the same functions against verl's own).

Inputs are built in log space: rollout_log_prob = 0 and old_log_prob = log r, so log r is exactly the fp32
value of math.log(r) and a bound equal to r sits exactly on the boundary.
"""

import math
import re

import pytest
import torch
from omegaconf import OmegaConf

from dppo.algo import (
    RS_OPTIONS,
    NonFiniteError,
    RolloutCorrectionConfig,
    RolloutCorrectionConfigError,
    ShapeMismatchError,
    compute_rollout_correction_and_rejection_mask,
    parse_rollout_rs_thresholds,
)

NAN = float("nan")
M = None  # a masked-out position


def logr_inputs(rows):
    """Ratios per row (None = masked) -> old_log_prob (log r, NaN where masked), rollout_log_prob (0), mask."""
    width = max(len(r) for r in rows)
    rows = [list(r) + [M] * (width - len(r)) for r in rows]
    old = torch.tensor([[NAN if r is M else math.log(r) for r in row] for row in rows])
    rollout = torch.tensor([[NAN if r is M else 0.0 for r in row] for row in rows])
    mask = torch.tensor([[r is not M for r in row] for row in rows])
    return old, rollout, mask


def correct(rows, **config):
    """(IS weights or None, modified mask, metrics) for ratios per row; checks the invariants of every result."""
    old, rollout, mask = logr_inputs(rows)
    weights, keep, metrics = compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, RolloutCorrectionConfig(**config)
    )
    assert keep.dtype == torch.bool and not torch.any(keep & ~mask)  # rejection only removes tokens
    if weights is not None:
        assert weights.dtype == torch.float32 and not weights.requires_grad
        assert torch.all(weights[~mask] == 0)
    return weights, keep, metrics


def weights_for(rows, **config):
    """IS weights (rollout_is must be set) and metrics, with no rejection configured."""
    weights, keep, metrics = correct(rows, **config)
    assert torch.equal(keep, logr_inputs(rows)[2])
    return weights, metrics


def expect(weights, rows):
    """Compare weights with expected rows (None = masked, must be 0)."""
    width = weights.shape[1]
    full = [[0.0 if v is M else v for v in list(r) + [M] * (width - len(r))] for r in rows]
    assert torch.allclose(weights, torch.tensor(full), rtol=1e-5, atol=1e-7), weights


# ---------------------------------------------------------------------------------------------------
# Importance weights
# ---------------------------------------------------------------------------------------------------


def test_no_is_gives_no_weights_and_the_mask_unchanged():
    w, keep, m = correct([[0.5, 3.0, M], [2.0]])
    assert w is None
    assert torch.equal(keep, torch.tensor([[True, True, False], [True, False, False]]))
    assert m["rollout_corr/weight_mean"] == 1.0 and m["rollout_corr/ess"] == pytest.approx(1.0)


def test_token_is_truncated_at_u_with_metrics():
    # r = [0.5, 1, 3 | 2, -] and an empty row; u = 2: w = [0.5, 1, 2 | 2] (r = 2 sits on u: not truncated)
    w, m = weights_for([[0.5, 1.0, 3.0], [2.0], [M]], rollout_is="token", rollout_is_threshold=2.0)
    expect(w, [[0.5, 1.0, 2.0], [2.0, M, M], [M, M, M]])
    n = 4  # valid tokens
    assert m["rollout_corr/weight_mean"] == pytest.approx((0.5 + 1 + 2 + 2) / n, rel=1e-6)
    assert m["rollout_corr/weight_max"] == pytest.approx(2.0, rel=1e-6)
    assert m["rollout_corr/weight_min"] == pytest.approx(0.5, rel=1e-6)
    assert m["rollout_corr/weight_truncated_frac"] == pytest.approx(1 / n)  # only r = 3
    assert m["rollout_corr/token_rejected_frac"] == 0.0
    assert m["rollout_corr/seq_rejected_frac"] == 0.0
    logs = [math.log(0.5), 0.0, math.log(3.0), math.log(2.0)]
    assert m["rollout_corr/kl_k1"] == pytest.approx(-sum(logs) / n, abs=1e-6)
    assert m["rollout_corr/kl_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in logs) / n, rel=1e-5)
    # ESS = (sum w)^2 / (n sum w^2) = 5.5^2 / (4 * (0.25 + 1 + 4 + 4))
    assert m["rollout_corr/ess"] == pytest.approx(5.5**2 / (4 * 9.25), rel=1e-6)


def test_sequence_is_is_the_product_of_ratios_truncated():
    # row 0: 2 * 0.5 * 3 = 3 (under u = 5); row 1: 2 * 4 = 8 -> 5; row 2: 0.25
    w, m = weights_for([[2.0, 0.5, 3.0], [2.0, 4.0], [0.25]], rollout_is="sequence", rollout_is_threshold=5.0)
    expect(w, [[3.0, 3.0, 3.0], [5.0, 5.0, M], [0.25, M, M]])
    assert m["rollout_corr/weight_truncated_frac"] == pytest.approx(2 / 6)  # the two tokens of row 1


def test_sequence_is_never_overflows():
    # 50 tokens at r = e^20 each: prod r = e^1000 would be inf in fp32; truncated at u = 2 instead.
    old = torch.full((1, 50), 20.0)
    w, _, m = compute_rollout_correction_and_rejection_mask(
        old, torch.zeros(1, 50), torch.ones(1, 50), RolloutCorrectionConfig(rollout_is="sequence")
    )
    assert torch.allclose(w, torch.full((1, 50), 2.0))
    assert all(math.isfinite(v) for v in m.values())


def test_sequence_is_clamps_the_summed_log_ratio_not_each_token():
    # Regression (verl parity): log r = (30, -25) per token sums to 5, so the weight is e^5. Clamping each token
    # to +-20 first, as dppo did, summed to 0 and gave weight 1.
    old, rollout = torch.tensor([[30.0, -25.0]]), torch.zeros(1, 2)
    cfg = RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=1e6)
    w, _, _ = compute_rollout_correction_and_rejection_mask(old, rollout, torch.ones(1, 2), cfg)
    assert torch.allclose(w, torch.full((1, 2), math.exp(5.0)), rtol=1e-6)


def test_token_is_band_zeroes_outside_inclusive_bounds():
    # band [0.5, 2]: 0.4 and 2.1 fall outside (weight 0, still in the loss mask); 0.5 and 2 sit on the bounds
    w, keep, m = correct([[0.4, 0.5, 2.0, 2.1, 1.0]], rollout_is="token", rollout_is_threshold="0.5_2.0")
    expect(w, [[0.0, 0.5, 2.0, 0.0, 1.0]])
    assert keep.all()  # the band zeroes weights; it rejects nothing
    assert m["rollout_corr/weight_zeroed_frac"] == pytest.approx(2 / 5)
    assert m["rollout_corr/token_rejected_frac"] == 0.0
    assert m["rollout_corr/weight_truncated_frac"] == 0.0
    assert m["rollout_corr/weight_min"] == 0.0


def test_sequence_is_band_zeroes_whole_sequences():
    # products: 3 (in [0.5, 4]), 8 (out), 0.5 (on the lower bound, in)
    w, m = weights_for([[2.0, 0.5, 3.0], [2.0, 4.0], [0.5]], rollout_is="sequence", rollout_is_threshold="0.5_4")
    expect(w, [[3.0, 3.0, 3.0], [0.0, 0.0, M], [0.5, M, M]])
    assert m["rollout_corr/weight_zeroed_frac"] == pytest.approx(2 / 6)
    assert m["rollout_corr/seq_rejected_frac"] == 0.0


@pytest.mark.parametrize("threshold", [5.0, "0.1_10"])
def test_token_batch_normalize_divides_by_the_mean_over_valid_tokens(threshold):
    # weights (0.5, 1, 3 | 2) have mean 6.5 / 4 over the valid tokens; the empty row counts for nothing
    rows = [[0.5, 1.0, 3.0], [2.0, M, M], [M]]
    w, m = weights_for(rows, rollout_is="token", rollout_is_threshold=threshold, rollout_is_batch_normalize=True)
    mean = 6.5 / 4
    expect(w, [[0.5 / mean, 1.0 / mean, 3.0 / mean], [2.0 / mean, M, M], [M, M, M]])
    assert m["rollout_corr/weight_batch_mean"] == pytest.approx(mean, rel=1e-6)
    assert m["rollout_corr/weight_mean"] == pytest.approx(1.0, rel=1e-6)


def test_sequence_batch_normalize_divides_by_the_mean_over_sequences():
    # sequence weights 3 (3 tokens) and 0.5 (1 token): mean over sequences (3 + 0.5) / 2, not over tokens
    w, m = weights_for(
        [[2.0, 0.5, 3.0], [0.5]], rollout_is="sequence", rollout_is_threshold=5.0, rollout_is_batch_normalize=True
    )
    mean = 3.5 / 2
    expect(w, [[3.0 / mean] * 3, [0.5 / mean, M, M]])
    assert m["rollout_corr/weight_batch_mean"] == pytest.approx(mean, rel=1e-6)


def test_batch_normalize_leaves_weights_whose_mean_is_tiny():
    # every weight outside the band is 0: the mean is 0 <= 1e-8 and the weights stay as they are (verl's rule)
    w, m = weights_for([[4.0, 5.0]], rollout_is="token", rollout_is_threshold="0.5_2", rollout_is_batch_normalize=True)
    expect(w, [[0.0, 0.0]])
    assert m["rollout_corr/weight_batch_mean"] == 0.0


# ---------------------------------------------------------------------------------------------------
# Rejection sampling: one case per option; rows give r = pi_prox / pi_behav. A k1 band [lo, hi] bounds
# pi_behav / pi_prox = 1 / r (verl's k1 statistic is -log r).
# ---------------------------------------------------------------------------------------------------

E = math.e


# (option, threshold, ratios per row (M = masked), kept per row)
RS_CASES = [
    # token_k1: 1 / r in [lo, hi], bounds inclusive
    ("token_k1", "0.5_2.0", [[0.4, 0.5, 2.0, 2.5]], [[0, 1, 1, 0]]),
    ("token_k1", 2.0, [[0.4, 0.5, 2.0, 2.5]], [[0, 1, 1, 0]]),  # u = 2 means [1/2, 2]
    # asymmetric band [0.5, 1.5] on 1 / r = (1.67, 1.43, 0.53, 0.5, 0.4, 2): r in [2/3, 2] is kept. Regression:
    # dppo used to bound r itself, keeping 0.6 and 0.7 and dropping 1.9 and 2.
    ("token_k1", "0.5_1.5", [[0.6, 0.7, 1.9, 2.0, 2.5, 0.5]], [[0, 1, 1, 1, 0, 0]]),
    # seq_sum_k1 on [0.8, 2.0]: 1 / prod r = 1 / (0.5 * 1.5) = 1.33 (in), 1 / (2 * 1) = 0.5 (out), 1 / 1.2 (in)
    ("seq_sum_k1", "0.8_2.0", [[0.5, 1.5], [2.0, 1.0], [1.2, M]], [[1, 1], [0, 0], [1, 0]]),
    # seq_mean_k1 on [0.8, 2.0]: 1 / geometric mean = 1 / sqrt(0.5) = 1.41 (in), 1 / sqrt(2) = 0.71 (out)
    ("seq_mean_k1", "0.8_2.0", [[0.5, 1.0], [2.0, 1.0]], [[1, 1], [0, 0]]),
    # token_k2: (log r)^2 / 2 <= hi; log r = 1, -1, 1.5, 0 -> 0.5, 0.5, 1.125, 0
    ("token_k2", 0.5, [[E, 1 / E, E**1.5, 1.0]], [[1, 1, 0, 1]]),
    # token_k3: r - 1 - log r <= hi; log r = 0, 1, -1 -> 0, e - 2 = 0.718, 1/e = 0.368
    ("token_k3", 0.5, [[1.0, E, 1 / E]], [[1, 0, 1]]),
    # seq_sum_k1: prod r in [0.5, 2]: 4 (out), 1 (in), 2 (on the bound, in)
    ("seq_sum_k1", "0.5_2", [[2.0, 2.0], [2.0, 0.5], [2.0, 1.0]], [[0, 0], [1, 1], [1, 1]]),
    # seq_mean_k1: geometric mean over VALID tokens in [1/2, 2]: sqrt(4.5) = 2.12 (out; over T=3 it would be
    # 4.5^(1/3) = 1.65, in), sqrt(4) = 2 (on the bound, in)
    ("seq_mean_k1", 2.0, [[4.5, 1.0, M], [4.0, 1.0, M]], [[0, 0, 0], [1, 1, 0]]),
    # seq_sum_k2: sum of (log r)^2 / 2 <= 1: 0.5 + 0.5 = 1 (on the bound, in), 1.5 (out)
    ("seq_sum_k2", 1.0, [[E, E], [E, E, E]], [[1, 1, 0], [0, 0, 0]]),
    # seq_mean_k2: mean over valid tokens <= 0.8: (2 + 0) / 2 = 1 (out; over T=3 it would be 0.67, in)
    ("seq_mean_k2", 0.8, [[E**2, 1.0, M], [E, 1.0, M]], [[0, 0, 0], [1, 1, 0]]),
    # seq_max_k2: max <= 0.5: max(0.5, 0.125) = 0.5 (on the bound, in), max(1.125, 0) (out)
    ("seq_max_k2", 0.5, [[E, E**0.5], [E**1.5, 1.0]], [[1, 1], [0, 0]]),
    # k3 of log r = (1, -1): (0.718, 0.368): sum 1.086, mean 0.543, max 0.718; row (1, 1): all 0
    ("seq_sum_k3", 1.0, [[E, 1 / E], [1.0, 1.0]], [[0, 0], [1, 1]]),
    ("seq_sum_k3", 1.1, [[E, 1 / E], [1.0, 1.0]], [[1, 1], [1, 1]]),
    ("seq_mean_k3", 0.6, [[E, 1 / E], [1.0, 1.0]], [[1, 1], [1, 1]]),
    ("seq_mean_k3", 0.5, [[E, 1 / E], [1.0, 1.0]], [[0, 0], [1, 1]]),
    ("seq_max_k3", 0.7, [[E, 1 / E], [1.0, 1.0]], [[0, 0], [1, 1]]),
    ("seq_max_k3", 0.72, [[E, 1 / E], [1.0, 1.0]], [[1, 1], [1, 1]]),
]


@pytest.mark.parametrize("option, threshold, rows, kept", RS_CASES)
def test_rejection_option(option, threshold, rows, kept):
    w, keep, m = correct(rows, rollout_rs=option, rollout_rs_threshold=threshold)
    assert w is None
    kept_t = torch.tensor(kept, dtype=torch.bool)
    assert torch.equal(keep, kept_t)
    mask = logr_inputs(rows)[2]
    assert m["rollout_corr/token_rejected_frac"] == pytest.approx((mask & ~kept_t).sum().item() / mask.sum().item())


def test_every_rs_option_has_a_case():
    # Read from the table itself, so deleting an option's last case fails here.
    tested = {option for option, *_ in RS_CASES}
    assert tested == set(RS_OPTIONS), f"no case for {sorted(set(RS_OPTIONS) - tested)}"


def test_chained_options_must_all_pass_and_weights_stay_independent():
    # token_k1 [0.5, 2] rejects the 3.0 token; seq_max_k2 <= 0.7 rejects row 1 (max k2 = (log 4)^2 / 2 = 0.96)
    # but not row 0 (max k2 = (log 3)^2 / 2 = 0.60, from the token that token_k1 rejects). The IS weights are
    # computed on every valid token, as verl does: rejection lives in the mask only.
    rows = [[1.5, 3.0, 0.8], [4.0, 1.0], [1.2]]
    w, keep, m = correct(
        rows,
        rollout_is="token",
        rollout_is_threshold=1.4,
        rollout_rs="token_k1,seq_max_k2",
        rollout_rs_threshold="0.5_2.0,0.7",
    )
    assert torch.equal(keep, torch.tensor([[True, False, True], [False, False, False], [True, False, False]]))
    expect(w, [[1.4, 1.4, 0.8], [1.4, 1.0, M], [1.2, M, M]])
    assert m["rollout_corr/token_rejected_frac"] == pytest.approx(3 / 6)
    assert m["rollout_corr/seq_rejected_frac"] == pytest.approx(1 / 3)  # row 0 keeps two tokens: not rejected
    assert m["rollout_corr/weight_truncated_frac"] == pytest.approx(3 / 6)  # 1.5, 3 and 4 -> 1.4
    ws = [1.4, 1.4, 0.8, 1.4, 1.0, 1.2]
    assert m["rollout_corr/ess"] == pytest.approx(sum(ws) ** 2 / (6 * sum(x * x for x in ws)), rel=1e-5)


def test_seq_rejected_frac_ignores_empty_sequences():
    # rows 0 and 1 have tokens, row 2 is empty: 1 of 2 sequences rejected, not 1 of 3
    _, keep, m = correct([[4.0], [1.0], [M]], rollout_rs="seq_sum_k1", rollout_rs_threshold=2.0)
    assert torch.equal(keep, torch.tensor([[False], [True], [False]]))
    assert m["rollout_corr/seq_rejected_frac"] == pytest.approx(1 / 2)


def test_all_masked_gives_zero_weights_and_zero_metrics():
    old = torch.full((2, 3), NAN)
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_rs="seq_max_k3", rollout_rs_threshold=0.1)
    w, keep, m = compute_rollout_correction_and_rejection_mask(old, old, torch.zeros(2, 3), cfg)
    assert torch.equal(w, torch.zeros(2, 3)) and not keep.any()
    assert all(v == 0.0 for v in m.values())


def test_log_ratio_is_clamped_to_20():
    # log r = 50 would give r = e^50; clamped it is e^20, and kl_k1 reports -20
    w, m = weights_for([[math.exp(50.0)]], rollout_is="token", rollout_is_threshold=1e12)
    assert w.item() == pytest.approx(math.exp(20.0), rel=1e-5)
    assert m["rollout_corr/kl_k1"] == pytest.approx(-20.0)


def test_correction_input_errors():
    old, rollout, mask = logr_inputs([[1.0, 2.0]])
    cfg = RolloutCorrectionConfig()
    match = r"rollout_log_prob has shape \(1, 1\) but response_mask has shape \(1, 2\)"
    with pytest.raises(ShapeMismatchError, match=match):
        compute_rollout_correction_and_rejection_mask(old, rollout[:, :1], mask, cfg)
    bad = rollout.clone()
    bad[0, 1] = -float("inf")
    with pytest.raises(NonFiniteError, match=r"rollout_log_prob is not finite: value -inf at index \[0, 1\]"):
        compute_rollout_correction_and_rejection_mask(old, bad, mask, cfg)
    with pytest.raises(TypeError, match="config must be a RolloutCorrectionConfig"):
        compute_rollout_correction_and_rejection_mask(old, rollout, mask, {"rollout_is": "token"})


@pytest.mark.parametrize("shape", [(4,), (2, 2, 2), ()])
@pytest.mark.parametrize("rollout_is", [None, "token", "sequence"])
def test_correction_rejects_non_2d_inputs(shape, rollout_is):
    # 1-D input with rollout_is="sequence" used to give weights [1, 1, 1, 1]: each token taken as a sequence.
    old, rollout = torch.full(shape, 0.5), torch.zeros(shape)
    cfg = RolloutCorrectionConfig(rollout_is=rollout_is)
    match = rf"response_mask must have shape \(B, T\); got shape {re.escape(str(shape))}"
    with pytest.raises(ValueError, match=match):
        compute_rollout_correction_and_rejection_mask(old, rollout, torch.ones(shape), cfg)


def test_bf16_inputs_give_fp32_weights():
    old, rollout, mask = logr_inputs([[0.5, 1.0, 3.0]])
    w, _, _ = compute_rollout_correction_and_rejection_mask(
        old.bfloat16(), rollout.bfloat16(), mask, RolloutCorrectionConfig(rollout_is="token")
    )
    assert w.dtype == torch.float32
    assert torch.allclose(w, torch.tensor([[0.5, 1.0, 2.0]]), rtol=1e-2)


# ---------------------------------------------------------------------------------------------------
# Threshold parser
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, spec, expected",
    [
        ("token_k1", 2.0, {"token_k1": (0.5, 2.0)}),
        ("token_k1", 4, {"token_k1": (0.25, 4.0)}),
        ("token_k1", "2", {"token_k1": (0.5, 2.0)}),
        ("token_k1", "0.5_3.0", {"token_k1": (0.5, 3.0)}),
        ("token_k1", "1_1", {"token_k1": (1.0, 1.0)}),  # lo == hi is allowed
        ("token_k1", 1, {"token_k1": (1.0, 1.0)}),
        ("seq_mean_k1", "1e-1_1e1", {"seq_mean_k1": (0.1, 10.0)}),
        ("token_k2", 0.5, {"token_k2": (None, 0.5)}),
        ("seq_max_k3", "0.01", {"seq_max_k3": (None, 0.01)}),
        ("token_k1,token_k2", 2.0, {"token_k1": (0.5, 2.0), "token_k2": (None, 2.0)}),  # one entry for all
        ("token_k1,seq_max_k3", "0.5_2.0,0.01", {"token_k1": (0.5, 2.0), "seq_max_k3": (None, 0.01)}),
        (" seq_sum_k1 , seq_sum_k3 ", " 1.5 , 0.2 ", {"seq_sum_k1": (1 / 1.5, 1.5), "seq_sum_k3": (None, 0.2)}),
        (["seq_mean_k2", "token_k1"], "3,0.25_4", {"seq_mean_k2": (None, 3.0), "token_k1": (0.25, 4.0)}),
        # as verl: empty entries and repeated options are dropped (regression: dppo refused both)
        ("token_k1,token_k1", 2.0, {"token_k1": (0.5, 2.0)}),
        ("token_k1,", "2.0,", {"token_k1": (0.5, 2.0)}),
        ("token_k1,,seq_max_k3", "0.5_2.0,,0.01", {"token_k1": (0.5, 2.0), "seq_max_k3": (None, 0.01)}),
    ],
)
def test_parse_rs_thresholds_valid(options, spec, expected):
    got = parse_rollout_rs_thresholds(options, spec)
    assert list(got) == list(expected)  # order follows the options
    for name, (lo, hi) in expected.items():
        assert got[name][1] == pytest.approx(hi)
        assert got[name][0] == (None if lo is None else pytest.approx(lo))


@pytest.mark.parametrize(
    "options, spec, match",
    [
        ("token_k1", "3_2", r"for 'token_k1': lower bound 3.0 > upper bound 2.0"),
        ("seq_sum_k1", "2.5_0.4", r"for 'seq_sum_k1': lower bound 2.5 > upper bound 0.4"),
        ("token_k1", 0.5, r"for 'token_k1'.*u must be >= 1.*lower bound 2.0 > upper bound 0.5"),
        ("token_k2", "0.5_2", r"for 'token_k2' must be one number.*got '0.5_2'"),
        ("seq_max_k3", "0.1_1", r"for 'seq_max_k3' must be one number"),
        ("token_k1,token_k2", "1,2,3", r"has 3 entries .* rollout_rs has 2 options"),
        ("token_k1,token_k2,token_k3", "1,2", r"has 2 entries"),
        ("token_k1", None, r"rollout_rs_threshold is required when rollout_rs is set"),
        ("token_k1", "nan", r"for 'token_k1' must be finite and > 0; got 'nan'"),
        ("token_k1", float("inf"), r"must be finite and > 0; got inf"),
        ("token_k2", 0, r"for 'token_k2' must be finite and > 0; got 0"),
        ("token_k2", -1.0, r"must be finite and > 0; got -1.0"),
        ("token_k1", "0_2", r"\(lower bound\) must be finite and > 0; got '0'"),
        ("token_k2", "abc", r"for 'token_k2' must be a number; got 'abc'"),
        ("token_k2", "", r"must be a number; got ''"),
        ("token_k2", True, r"must be a number or a string; got True"),
        ("token_k2", [0.5], r"must be a number or a string; got \[0.5\]"),
        ("token_k1", "0.5_2_3", r"must be a number or 'lo_hi'"),
        ("token_k1", "_2", r"\(lower bound\) must be a number; got ''"),
        ("token_k4", 2.0, r"rollout_rs must be None or a comma-chain of token_k1, .*; got 'token_k4'"),
        ("seq_max_k1", 2.0, r"comma-chain of"),
        ("token_k1,token_k1", "2,3", r"has 2 entries .* rollout_rs has 1 options"),
        ("token_k2", " , ", r"must be a number; got ' , '"),
        ("", 2.0, r"comma-chain of"),
        (3, 2.0, r"rollout_rs must be None or a comma-separated string"),
    ],
)
def test_parse_rs_thresholds_invalid(options, spec, match):
    with pytest.raises(RolloutCorrectionConfigError, match=match):
        parse_rollout_rs_thresholds(options, spec)


# ---------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------


def test_config_defaults_are_verl_like():
    cfg = RolloutCorrectionConfig()
    assert (cfg.rollout_is, cfg.rollout_is_threshold) == (None, 2.0)
    assert (cfg.rollout_rs, cfg.rollout_rs_threshold) == (None, None)
    assert (cfg.bypass_mode, cfg.loss_type) == (False, "ppo_clip")
    assert cfg.is_bounds == (None, 2.0) and dict(cfg.rs_bounds) == {}


def test_config_parses_thresholds_and_canonicalizes_rs():
    cfg = RolloutCorrectionConfig(
        rollout_is="sequence",
        rollout_is_threshold="0.5_4",
        rollout_rs=["token_k1", " seq_max_k3"],
        rollout_rs_threshold="2,0.1",
    )
    assert cfg.is_bounds == (0.5, 4.0)
    assert cfg.rollout_rs == "token_k1,seq_max_k3"
    assert dict(cfg.rs_bounds) == {"token_k1": (0.5, 2.0), "seq_max_k3": (None, 0.1)}
    assert RolloutCorrectionConfig(rollout_is_threshold="3").is_bounds == (None, 3.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(rollout_is="tok"),
            "algorithm.rollout_correction.rollout_is must be one of None, 'token', 'sequence'; got 'tok'",
        ),
        (dict(rollout_is=True), "rollout_is must be one of .*; got True"),
        (dict(rollout_is_threshold=0.0), "rollout_is_threshold must be finite and > 0; got 0.0"),
        (dict(rollout_is_threshold="x"), "rollout_is_threshold must be a number; got 'x'"),
        (dict(rollout_is_threshold="4_0.5"), "rollout_is_threshold: lower bound 4.0 > upper bound 0.5"),
        (dict(rollout_is_threshold=None), "rollout_is_threshold must be a number; got None"),
        (dict(rollout_rs="token_k1"), "rollout_rs_threshold is required"),
        (dict(rollout_rs="token_k9", rollout_rs_threshold=2), "rollout_rs must be None or a comma-chain"),
        (dict(bypass_mode="yes"), "algorithm.rollout_correction.bypass_mode must be a bool; got 'yes'"),
        (dict(loss_type="ppo"), "loss_type must be one of 'ppo_clip', 'reinforce'; got 'ppo'"),
        (dict(loss_type="reinforce"), "loss_type='reinforce' applies only in bypass mode"),
    ],
)
def test_config_rejects_invalid_values(kwargs, match):
    with pytest.raises(RolloutCorrectionConfigError, match=match):
        RolloutCorrectionConfig(**kwargs)


# rollout_rs_threshold with rollout_rs=None: checked on its own (no options to match it against), so a
# config that is hashable and valid today stays valid when rollout_rs is switched on with a matching spec.
@pytest.mark.parametrize(
    "threshold, match",
    [
        ("garbage", r"rollout_correction.rollout_rs_threshold must be a number; got 'garbage'"),
        (-1, r"rollout_correction.rollout_rs_threshold must be finite and > 0; got -1"),
        (0.0, r"rollout_rs_threshold must be finite and > 0; got 0.0"),
        (float("nan"), r"rollout_rs_threshold must be finite and > 0; got nan"),
        ("3_2", r"rollout_rs_threshold: lower bound 3.0 > upper bound 2.0"),
        ("0.5_2,x", r"rollout_rs_threshold must be a number; got 'x'"),
        ([1, 2], r"rollout_rs_threshold must be a number or a string; got \[1, 2\]"),
        ((2.0,), r"rollout_rs_threshold must be a number or a string; got \(2.0,\)"),
        (True, r"rollout_rs_threshold must be a number or a string; got True"),
    ],
)
def test_config_rejects_invalid_rs_threshold_without_rs(threshold, match):
    with pytest.raises(RolloutCorrectionConfigError, match=match):
        RolloutCorrectionConfig(rollout_rs_threshold=threshold)


@pytest.mark.parametrize("threshold", [None, 2.0, 0.01, 3, "0.5", "0.5_2.0", "0.5_2.0,0.1", 0.5])
def test_config_accepts_valid_rs_threshold_without_rs(threshold):
    cfg = RolloutCorrectionConfig(rollout_rs_threshold=threshold)
    assert cfg.rollout_rs is None and dict(cfg.rs_bounds) == {}
    assert cfg.rollout_rs_threshold == threshold
    assert hash(cfg) == hash(RolloutCorrectionConfig(rollout_rs_threshold=threshold))


@pytest.mark.parametrize("threshold", [[2.0], (0.5, 2.0), {"u": 2.0}])
def test_config_rejects_container_is_threshold(threshold):
    with pytest.raises(RolloutCorrectionConfigError, match=r"rollout_is_threshold must be a number; got"):
        RolloutCorrectionConfig(rollout_is_threshold=threshold)


def test_config_from_dict_and_omegaconf():
    section = OmegaConf.create(
        {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.05}
    )
    cfg = RolloutCorrectionConfig.from_dict(section)
    assert cfg == RolloutCorrectionConfig(
        rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.05
    )
    assert dict(cfg.rs_bounds) == {"seq_mean_k3": (None, 0.05)}
    match = r"unknown key\(s\) \['rollout_is_thresh'\].*valid keys: rollout_is,"
    with pytest.raises(RolloutCorrectionConfigError, match=match):
        RolloutCorrectionConfig.from_dict({"rollout_is_thresh": 2.0})


def test_config_is_frozen_and_hashable():
    cfg = RolloutCorrectionConfig(rollout_rs="token_k1", rollout_rs_threshold=2.0)
    with pytest.raises(AttributeError):
        cfg.rollout_is = "token"
    with pytest.raises(TypeError):
        cfg.rs_bounds["token_k2"] = (None, 1.0)
    assert hash(cfg) == hash(RolloutCorrectionConfig(rollout_rs="token_k1", rollout_rs_threshold=2.0))
