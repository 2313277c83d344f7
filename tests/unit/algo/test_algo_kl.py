"""Hand-computed k1, k2, k3 KL penalties and the KL loss term."""

import math

import pytest
import torch

from dppo.algo import NonFiniteError, UnknownNameError, kl_loss, kl_penalty

NAN = float("nan")
# log pi - log pi_ref per token: 1, -1, 0.5
LOG_RATIO = [1.0, -1.0, 0.5]


def inputs():
    log_prob = torch.tensor([[-1.0, -2.0, -0.5, NAN]], requires_grad=True)
    ref = log_prob.detach() - torch.tensor([LOG_RATIO + [0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    return log_prob, ref, mask


@pytest.mark.parametrize(
    "kind, per_token, grad",
    [
        # k1 = x; d/dx = 1
        ("k1", LOG_RATIO, [1.0, 1.0, 1.0]),
        # k2 = x^2 / 2; d/dx = x
        ("k2", [0.5, 0.5, 0.125], LOG_RATIO),
        # k3 = e^-x - 1 + x; d/dx = 1 - e^-x
        ("k3", [math.exp(-x) - 1 + x for x in LOG_RATIO], [1 - math.exp(-x) for x in LOG_RATIO]),
        ("low_var_kl", [math.exp(-x) - 1 + x for x in LOG_RATIO], [1 - math.exp(-x) for x in LOG_RATIO]),
    ],
)
def test_kl_penalty_values_and_gradients(kind, per_token, grad):
    log_prob, ref, mask = inputs()
    kl = kl_penalty(log_prob, ref, kind, response_mask=mask)
    assert kl.dtype == torch.float32 and kl.shape == (1, 4)
    assert kl[0, :3].tolist() == pytest.approx(per_token, rel=1e-6)
    kl.sum().backward()
    assert log_prob.grad[0, :3].tolist() == pytest.approx(grad, rel=1e-5)
    assert log_prob.grad[0, 3] == 0  # the masked NaN never leaks


def test_k3_is_clamped_at_10():
    kl = kl_penalty(torch.tensor([[-20.0]]), torch.tensor([[0.0]]), "k3")  # e^20 - 1 - 20
    assert kl.item() == 10.0


def test_only_k3_clamps_the_log_ratio():
    # Regression (verl parity): k1 and k2 use log pi - log pi_ref as it is; dppo clamped it to +-20 first.
    log_prob, ref = torch.tensor([[-31.0, -1.0]]), torch.tensor([[-1.0, -31.0]])  # log r = -30, 30
    assert kl_penalty(log_prob, ref, "k1").tolist() == [[-30.0, 30.0]]
    assert kl_penalty(log_prob, ref, "k2").tolist() == [[450.0, 450.0]]
    # k3: log pi_ref / pi = 30 -> clamped to 20, e^20 - 20 - 1 -> clamped to 10; -30 -> -20: e^-20 + 20 - 1 = 19 -> 10
    assert kl_penalty(log_prob, ref, "k3").tolist() == [[10.0, 10.0]]


def test_kl_loss_term_and_metrics():
    log_prob, ref, mask = inputs()
    term, m = kl_loss(log_prob, ref, mask, coef=0.5, kind="k2")
    mean_k2 = (0.5 + 0.5 + 0.125) / 3
    assert term.item() == pytest.approx(0.5 * mean_k2, rel=1e-6)
    assert m == {"actor/kl_loss": pytest.approx(mean_k2, rel=1e-6), "actor/kl_coef": 0.5}


def test_kl_errors():
    log_prob, ref, mask = inputs()
    with pytest.raises(UnknownNameError, match="unknown KL penalty kind 'k4'; valid names: 'k1', 'kl', 'k2'"):
        kl_penalty(log_prob, ref, "k4")
    ref[0, 1] = NAN
    with pytest.raises(NonFiniteError, match=r"ref_log_prob is not finite: value nan at index \[0, 1\]"):
        kl_penalty(log_prob, ref, response_mask=mask)
    with pytest.raises(NonFiniteError, match="ref_log_prob"):
        kl_loss(log_prob, ref, mask, coef=0.1)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
@pytest.mark.parametrize("arg, bad", [("log_prob", NAN), ("ref_log_prob", float("inf")), ("log_prob", -float("inf"))])
def test_kl_penalty_without_mask_rejects_non_finite_anywhere(kind, arg, bad):
    # Without response_mask every position is valid, so a NaN/inf there is an error, not a silent NaN (k1 returned
    # [[0, nan, 0]]) or a silently clamped value (k2/k3 of +-inf hit the +-20 clamp).
    inputs = {"log_prob": torch.zeros(1, 3), "ref_log_prob": torch.zeros(1, 3)}
    inputs[arg][0, 1] = bad
    match = rf"{arg} is not finite: value -?(nan|inf) at index \[0, 1\] \(no response_mask: every position is valid\)"
    with pytest.raises(NonFiniteError, match=match):
        kl_penalty(inputs["log_prob"], inputs["ref_log_prob"], kind)


def test_kl_penalty_without_mask_accepts_any_shape():
    # The estimators are per element: a (B, T) batch and a flat (N,) one give the same numbers.
    log_prob, ref = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]]), torch.full((2, 2), -1.5)
    flat = kl_penalty(log_prob.reshape(-1), ref.reshape(-1), "k3")
    assert torch.equal(flat.view(2, 2), kl_penalty(log_prob, ref, "k3"))


@pytest.mark.parametrize("shape", [(4,), (2, 2, 2)])
def test_kl_loss_rejects_non_2d_inputs(shape):
    x = torch.zeros(shape)
    with pytest.raises(ValueError, match=r"response_mask must have shape \(B, T\); got shape \((4,|2, 2, 2)\)"):
        kl_loss(x, x, torch.ones(shape), coef=0.1, loss_agg_mode="seq-mean-token-mean")
