"""On a GPU: the algo functions give the CPU results, and log_probs_from_logits stays within its chunk budget.

Marked cuda: skipped without a GPU (tests/conftest.py).
"""

import pytest
import torch

from dppo.algo import (
    RolloutCorrectionConfig,
    compute_rollout_correction_and_rejection_mask,
    entropy_from_logits,
    grpo_advantages,
    log_probs_from_logits,
    policy_loss,
)

pytestmark = pytest.mark.cuda
MiB = 2**20


def _peak_extra_bytes(fn):
    """Run fn on the GPU; return (its result, peak bytes allocated above what was allocated before)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


def test_log_probs_peak_memory_follows_the_chunk_budget_not_the_vocabulary():
    batch, seq, vocab = 4, 256, 32768
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(batch, seq, vocab, device="cuda", generator=gen).bfloat16().requires_grad_(True)  # 64 MiB
    labels = torch.randint(0, vocab, (batch, seq), device="cuda", generator=gen)
    full_fp32_bytes = batch * seq * vocab * 4  # 128 MiB: what log_softmax(logits.float()) would allocate
    chunk_bytes = 8 * MiB

    logp, forward_peak = _peak_extra_bytes(lambda: log_probs_from_logits(logits, labels, 0.8, chunk_bytes=chunk_bytes))
    assert forward_peak <= 2 * chunk_bytes, (forward_peak, full_fp32_bytes)

    # Backward must produce d/dlogits (bf16, 64 MiB); beyond that only per-chunk work.
    _, backward_peak = _peak_extra_bytes(lambda: logp.sum().backward())
    assert backward_peak <= logits.numel() * 2 + 2 * chunk_bytes, backward_peak

    ref = torch.log_softmax(logits.detach().float() / 0.8, -1).gather(-1, labels[..., None]).squeeze(-1)
    assert torch.allclose(logp, ref, atol=1e-2)


def test_log_probs_and_entropy_match_the_cpu():
    gen = torch.Generator().manual_seed(1)
    logits = 3 * torch.randn(3, 17, 1000, generator=gen)
    labels = torch.randint(0, 1000, (3, 17), generator=gen)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        cpu = log_probs_from_logits(logits.to(dtype), labels, 0.7, chunk_bytes=100_000)
        gpu = log_probs_from_logits(logits.to(dtype).cuda(), labels.cuda(), 0.7, chunk_bytes=100_000)
        assert gpu.dtype == torch.float32 and torch.allclose(gpu.cpu(), cpu, atol=tol)
        cpu_h = entropy_from_logits(logits.to(dtype), chunk_bytes=100_000)
        gpu_h = entropy_from_logits(logits.to(dtype).cuda(), chunk_bytes=100_000)
        assert torch.allclose(gpu_h.cpu(), cpu_h, atol=tol)


def test_losses_weights_and_advantages_match_the_cpu():
    gen = torch.Generator().manual_seed(2)
    mask = torch.rand(6, 9, generator=gen) > 0.3
    old = torch.randn(6, 9, generator=gen) - 2
    rollout = old + 0.3 * torch.randn(6, 9, generator=gen)
    logp = old + 0.3 * torch.randn(6, 9, generator=gen)
    scores = torch.randn(6, generator=gen)
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    cfg = RolloutCorrectionConfig(
        rollout_is="token", rollout_rs="token_k1,seq_max_k3", rollout_rs_threshold="0.5_2.0,0.2"
    )

    def run(device):
        to = lambda x: x.to(device)  # noqa: E731
        adv = grpo_advantages(to(scores), to(groups), to(mask))
        weights, keep, rc = compute_rollout_correction_and_rejection_mask(to(old), to(rollout), to(mask), cfg)
        leaf = to(logp).requires_grad_(True)
        loss, m = policy_loss(leaf, to(old), adv, keep, weights=weights, clip_ratio_high=0.28)
        loss.backward()
        return adv.cpu(), weights.cpu(), loss.item(), leaf.grad.cpu(), {**rc, **m}, keep.cpu()

    cpu, gpu = run("cpu"), run("cuda")
    for a, b in zip(cpu[:2] + cpu[3:4], gpu[:2] + gpu[3:4]):
        assert torch.allclose(a, b, atol=1e-5)
    assert gpu[2] == pytest.approx(cpu[2], abs=1e-5)
    assert gpu[4] == pytest.approx(cpu[4], rel=1e-4, abs=1e-6)
    assert torch.equal(gpu[5], cpu[5])
