"""The log-linear approximation of log pi_prox (AReaL's loglinear) and its error metrics, against hand values."""

import math

import pytest
import torch

from dppo.algo import (
    AlgoInputError,
    NonFiniteError,
    loglinear_alpha,
    loglinear_prox_log_prob,
    prox_approx_metrics,
)

NAN = float("nan")


@pytest.mark.parametrize(
    "v_prox, v_theta, v_behav, alpha",
    [
        (8, 10, 4, 4 / 6),  # two steps into a cycle, data two cycles (of 4 steps) old
        (8, 10, 8, 0.0),  # data as new as pi_prox: pi_prox is pi_behav
        (8, 8, 4, 1.0),  # trigger 0: pi_theta is pi_prox
        (8, 8, 8, 0.0),  # v_theta == v_behav: nothing moved
        (8, 10, 9, 0.0),  # data newer than pi_prox (cannot happen in a cycle): clamped to 0
        (0, 3, 0, 0.0),
    ],
)
def test_alpha_by_hand(v_prox, v_theta, v_behav, alpha):
    assert loglinear_alpha(v_prox, v_theta, torch.tensor([v_behav])).item() == pytest.approx(alpha, abs=1e-12)


def test_exact_when_log_probs_move_linearly_in_versions():
    """If log pi_v = a + b v per token, the interpolation gives log pi_prox exactly, for every sequence version."""
    gen = torch.Generator().manual_seed(0)
    a, b = -2.0 * torch.rand(6, 5, generator=gen), 0.1 * torch.randn(6, 5, generator=gen)
    v_behav = torch.tensor([0, 2, 4, 5, 7, 8])  # (B,), in optimizer steps
    v_prox, v_theta = 8, 11
    behav = a + b * v_behav[:, None].float()
    theta = a + b * v_theta
    mask = torch.ones(6, 5, dtype=torch.bool)
    approx = loglinear_prox_log_prob(theta, behav, mask, v_prox=v_prox, v_theta=v_theta, v_behav=v_behav)
    torch.testing.assert_close(approx, a + b * v_prox, rtol=0, atol=1e-5)
    assert approx.dtype == torch.float32 and not approx.requires_grad


def test_per_token_versions_and_value_by_hand():
    theta = torch.tensor([[-1.0, -2.0]])
    behav = torch.tensor([[-3.0, -2.5]])
    v_behav = torch.tensor([[4, 8]])  # (B, T): per-token versions (alpha 2/3 and 0)
    out = loglinear_prox_log_prob(theta, behav, torch.ones(1, 2), v_prox=8, v_theta=10, v_behav=v_behav)
    assert out.tolist()[0] == pytest.approx([-3.0 + (2 / 3) * 2.0, -2.5])


def test_masked_positions_never_leak_and_valid_nan_raises():
    theta = torch.tensor([[-1.0, NAN]], requires_grad=True)
    behav = torch.tensor([[-2.0, math.inf]])
    mask = torch.tensor([[1, 0]])
    out = loglinear_prox_log_prob(theta, behav, mask, v_prox=4, v_theta=5, v_behav=torch.tensor([0]))
    assert out[0, 0].item() == pytest.approx(-2.0 + 0.8 * 1.0) and out[0, 1].item() == 0.0
    with pytest.raises(NonFiniteError, match="log_prob is not finite"):
        loglinear_prox_log_prob(theta, behav, torch.ones(1, 2), v_prox=4, v_theta=5, v_behav=torch.tensor([0]))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(v_prox=5, v_theta=4, v_behav=torch.tensor([0])), "v_theta=4 < v_prox=5"),
        (dict(v_prox=-1, v_theta=4, v_behav=torch.tensor([0])), "v_prox must be an int >= 0"),
        (dict(v_prox=1.5, v_theta=4, v_behav=torch.tensor([0])), "v_prox must be an int"),
        (dict(v_prox=1, v_theta=4, v_behav=torch.tensor([0.5])), "integer optimizer-step counts"),
        (dict(v_prox=1, v_theta=4, v_behav=torch.tensor([0, 1])), r"shape \(B,\) = \(1,\)"),
    ],
)
def test_bad_versions_are_named(kwargs, match):
    logp = torch.zeros(1, 2)
    with pytest.raises(AlgoInputError, match=match):
        loglinear_prox_log_prob(logp, logp, torch.ones(1, 2), **kwargs)


def test_error_metrics_by_hand():
    approx = torch.tensor([[-1.0, -2.0, 7.0]])
    exact = torch.tensor([[-1.5, -2.0, NAN]])
    behav = torch.tensor([[-1.0, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    m = prox_approx_metrics(approx, exact, behav, mask)
    assert m["prox_approx/abs_err_mean"] == pytest.approx(0.25)
    assert m["prox_approx/abs_err_max"] == pytest.approx(0.5)
    w_err = abs(1.0 - math.exp(-0.5))  # token 0: weight 1 approximated, e^-0.5 exact; token 1: both e^-1
    assert m["prox_approx/is_weight_abs_err_mean"] == pytest.approx(w_err / 2)
    assert m["prox_approx/is_weight_abs_err_max"] == pytest.approx(w_err)
    assert prox_approx_metrics(exact, exact, behav, mask)["prox_approx/abs_err_max"] == 0.0
