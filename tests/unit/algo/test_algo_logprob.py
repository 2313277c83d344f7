"""log_probs_from_logits and entropy_from_logits against the plain log_softmax reference, chunking and memory."""

import pytest
import torch

from dppo.algo import (
    AlgoInputError,
    NonFiniteError,
    ShapeMismatchError,
    entropy_from_logits,
    log_probs_from_logits,
    policy_loss,
)
from dppo.algo.logprob import _rows_per_chunk


def reference_logp(logits, labels, temperature=1.0):
    return torch.log_softmax(logits.float() / temperature, -1).gather(-1, labels[..., None]).squeeze(-1)


def reference_entropy(logits, temperature=1.0, dtype=torch.float32):
    logp = torch.log_softmax(logits.to(dtype) / temperature, -1)
    return -(logp.exp() * logp).sum(-1)


def assert_grad_close(grad, ref_grad):
    """grad and the reference's, both in the logits' dtype: each is an fp32 value rounded once to that dtype, and
    the two fp32 values differ by rounding (~1e-7), which can round them to neighbouring values: one step of the
    dtype at the compared value, eps * |value| (bf16: 2^-7 relative, 0.03 at 4), is allowed, plus 1e-5 near 0."""
    assert grad.dtype == ref_grad.dtype
    rtol = 0.0 if grad.dtype == torch.float32 else torch.finfo(grad.dtype).eps
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=rtol, atol=1e-5)


def upstream_like(shape) -> torch.Tensor:
    """The gradient flowing into a test's output: seeded, so a test compares the same values on every run."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(1))


def make(batch=3, seq=9, vocab=37, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(batch, seq, vocab, generator=gen)).to(dtype)
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    return logits, labels


# chunk_bytes=1 gives one row per chunk; 5000 bytes gives 11 rows per chunk at V = 37 (a ragged last chunk).
@pytest.mark.parametrize("chunk_bytes", [1, 5000, 2**30])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_probs_match_reference_values_and_gradients(chunk_bytes, temperature, dtype):
    logits, labels = make(dtype=dtype)
    logits.requires_grad_(True)
    out = log_probs_from_logits(logits, labels, temperature, chunk_bytes=chunk_bytes)
    ref = reference_logp(logits, labels, temperature)
    assert out.dtype == torch.float32 and out.shape == labels.shape
    # fp32 values from the same (upcast) logits: fp32 rounding apart, whatever the logits' dtype
    torch.testing.assert_close(out.detach(), ref.detach(), rtol=0, atol=1e-5)
    upstream = upstream_like(labels.shape)
    (grad,) = torch.autograd.grad((out * upstream).sum(), logits)
    (ref_grad,) = torch.autograd.grad((ref * upstream).sum(), logits)
    assert grad.dtype == dtype
    assert_grad_close(grad, ref_grad)


@pytest.mark.parametrize("chunk_bytes", [1, 5000])
@pytest.mark.parametrize("temperature", [1.0, 1.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entropy_matches_reference_values_and_gradients(chunk_bytes, temperature, dtype):
    logits, _ = make(dtype=dtype)
    logits.requires_grad_(True)
    out = entropy_from_logits(logits, temperature=temperature, chunk_bytes=chunk_bytes)
    ref = reference_entropy(logits, temperature)
    assert out.dtype == torch.float32 and out.shape == logits.shape[:-1]
    torch.testing.assert_close(out.detach(), ref.detach(), rtol=0, atol=1e-5)
    upstream = upstream_like(out.shape)
    (grad,) = torch.autograd.grad((out * upstream).sum(), logits)
    (ref_grad,) = torch.autograd.grad((ref * upstream).sum(), logits)
    assert_grad_close(grad, ref_grad)


@pytest.mark.parametrize("vocab", [32_000, 151_936])
@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_entropy_is_fp32_accurate_at_a_real_vocabulary(vocab, scale):
    # Against an fp64 reference: summing p log p over ~1e5 entries must keep fp32 accuracy (a batched
    # matmul did not: up to 1e-3 off on the CPU, and backward reuses H). Few rows, so it stays fast;
    # chunk_bytes gives 2-row chunks.
    gen = torch.Generator().manual_seed(3)
    logits = (scale * torch.randn(2, 3, vocab, generator=gen)).requires_grad_(True)
    logits64 = logits.detach().double().requires_grad_(True)
    out = entropy_from_logits(logits, chunk_bytes=2 * 3 * 4 * vocab)
    ref = reference_entropy(logits64, dtype=torch.float64)
    assert torch.allclose(out.double(), ref, atol=1e-5, rtol=0), (out.double() - ref).abs().max()
    upstream = torch.randn(out.shape, generator=gen)
    (grad,) = torch.autograd.grad((out * upstream).sum(), logits)
    (ref_grad,) = torch.autograd.grad((ref * upstream.double()).sum(), logits64)
    assert torch.allclose(grad.double(), ref_grad, atol=1e-5, rtol=0), (grad.double() - ref_grad).abs().max()


def test_minus_inf_logits_are_zero_probability_not_nan():
    # Some models mask unused vocabulary entries with -inf; those carry p = 0 and must not turn into nan.
    logits, labels = make(seq=4, vocab=11)
    logits[..., 7:] = -float("inf")
    labels = labels % 7
    logits.requires_grad_(True)
    logp = log_probs_from_logits(logits, labels, chunk_bytes=100)
    entropy = entropy_from_logits(logits, chunk_bytes=100)
    finite = logits.detach()[..., :7].requires_grad_(True)  # the same distribution without the -inf entries
    assert torch.allclose(logp, reference_logp(finite, labels), atol=1e-5)
    assert torch.allclose(entropy, reference_entropy(finite), atol=1e-5)
    (grad,) = torch.autograd.grad(logp.sum() + entropy.sum(), logits)
    (ref_grad,) = torch.autograd.grad(reference_logp(finite, labels).sum() + reference_entropy(finite).sum(), finite)
    assert torch.equal(grad[..., 7:], torch.zeros_like(grad[..., 7:]))
    assert torch.allclose(grad[..., :7], ref_grad, atol=1e-5)


def test_non_contiguous_logits_slice_is_handled_without_a_copy_of_the_whole_batch():
    # The usual call: logits[:, :-1] predicts input_ids[:, 1:]; the slice cannot be viewed as (N, V).
    logits, labels = make(seq=10)
    logits.requires_grad_(True)
    shifted, targets = logits[:, :-1], labels[:, 1:]
    assert not shifted.is_contiguous()
    out = log_probs_from_logits(shifted, targets, chunk_bytes=1000)
    ref = reference_logp(shifted, targets)
    assert torch.allclose(out, ref, atol=1e-5)
    (grad,) = torch.autograd.grad(out.sum(), logits)
    (ref_grad,) = torch.autograd.grad(ref.sum(), logits)
    assert torch.allclose(grad, ref_grad, atol=1e-5)
    assert torch.all(grad[:, -1] == 0)


def test_rows_per_chunk_respects_the_byte_budget():
    assert _rows_per_chunk(vocab=1000, chunk_bytes=12_000 * 7) == 7  # 3 fp32 copies of 1000 per row
    assert _rows_per_chunk(vocab=150_000, chunk_bytes=1) == 1
    assert _rows_per_chunk(vocab=150_000, chunk_bytes=256 * 2**20) == 149


def test_forward_never_softmaxes_more_rows_than_a_chunk(monkeypatch):
    logits, labels = make(batch=4, seq=16, vocab=50)
    rows_seen = []
    real = torch.logsumexp

    def spy(x, dim, *args, **kwargs):
        rows_seen.append(x.shape[0])
        return real(x, dim, *args, **kwargs)

    monkeypatch.setattr(torch, "logsumexp", spy)
    chunk_bytes = 10 * 3 * 4 * 50  # 10 rows
    log_probs_from_logits(logits, labels, chunk_bytes=chunk_bytes)
    assert rows_seen == [10] * 6 + [4]  # 64 rows


def test_autograd_saves_no_full_size_fp32_tensor():
    # A plain log_softmax would save a (B, T, V) fp32 tensor for backward; ours saves the input logits
    # (bf16 here), the labels and one fp32 number per row.
    logits, labels = make(batch=2, seq=8, vocab=64, dtype=torch.bfloat16)
    logits.requires_grad_(True)
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        log_probs_from_logits(logits, labels, 0.9, chunk_bytes=1)
        entropy_from_logits(logits, chunk_bytes=1)
    fp32_elements = sum(n for dtype, n in saved if dtype == torch.float32)
    assert fp32_elements <= 3 * labels.numel()  # lse (logp), lse and entropy (entropy)
    assert all(n <= logits.numel() for _, n in saved)


def test_input_errors():
    logits, labels = make()
    with pytest.raises(ShapeMismatchError, match=r"labels has shape \(3, 8\) but logits has shape \(3, 9, 37\)"):
        log_probs_from_logits(logits, labels[:, :8])
    bad = labels.clone()
    bad[1, 2] = 37
    with pytest.raises(AlgoInputError, match=r"labels must lie in \[0, 37\).*got values from 0 to 37"):
        log_probs_from_logits(logits, bad)
    bad[1, 2] = -100  # an ignore index must not reach gather
    with pytest.raises(ValueError, match="from -100 to"):
        log_probs_from_logits(logits, bad)
    with pytest.raises(TypeError, match="labels must be an integer tensor; got dtype torch.float32"):
        log_probs_from_logits(logits, labels.float())
    with pytest.raises(TypeError, match="logits must be a floating-point tensor"):
        log_probs_from_logits(labels, labels[:, :1].squeeze(-1))
    for temperature in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(AlgoInputError, match="temperature must be finite and > 0"):
            log_probs_from_logits(logits, labels, temperature)
    with pytest.raises(ValueError, match="chunk_bytes must be a positive int; got 0"):
        entropy_from_logits(logits, chunk_bytes=0)


def test_nan_logits_stay_in_their_row_and_the_loss_rejects_them_where_valid():
    # Logits are not checked (documented): a NaN logit makes its own row's log-prob NaN, no other row's, and
    # policy_loss raises for it at a valid position and ignores it at a masked one.
    logits, labels = make(batch=2, seq=3, vocab=40)
    logits[1, 2, 5] = float("nan")
    logp = log_probs_from_logits(logits, labels, chunk_bytes=1000)
    assert torch.isnan(logp[1, 2]) and torch.isfinite(logp).sum() == 5
    assert torch.allclose(logp[:1], reference_logp(logits[:1], labels[:1]), atol=1e-5)
    old, adv = logp.detach().nan_to_num(0.0), torch.ones(2, 3)
    with pytest.raises(NonFiniteError, match=r"log_prob is not finite: value nan at index \[1, 2\]"):
        policy_loss(logp, old, adv, torch.ones(2, 3))
    mask = torch.ones(2, 3)
    mask[1, 2] = 0
    loss, _ = policy_loss(logp, old, adv, mask)
    assert torch.isfinite(loss)
