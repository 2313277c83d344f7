"""The micro-batched optimizer step: accumulated gradients equal the whole mini-batch's gradient."""

import copy

import pytest
import torch

from dppo.algo import log_probs_from_logits, policy_loss
from dppo.models import build_model
from dppo.rollout import TrainBatch
from dppo.trainer.actor import decoupled_loss, micro_batch_share, update_policy
from dppo.trainer.config import ActorConfig, ModelConfig

P, R, V, B = 4, 5, 12, 11


@pytest.fixture
def setup():
    gen = torch.Generator().manual_seed(0)
    model = build_model(ModelConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64), V, 1)
    mask = torch.rand(B, R, generator=gen) > 0.3
    mask[:, 0] = True
    mask[3] = False  # a sequence without valid tokens
    batch = TrainBatch(
        input_ids=torch.randint(0, V, (B, P + R), generator=gen),
        response_mask=mask,
        behav_logp=-torch.rand(B, R, generator=gen) - 1,
        scores=torch.rand(B, generator=gen),
        group_index=torch.arange(B) // 3,
        versions=torch.zeros(4, dtype=torch.long),
    )
    prox = -torch.rand(B, R, generator=gen) - 1
    adv = torch.randn(B, R, generator=gen)
    weights = torch.rand(B, R, generator=gen) * 2
    return model, batch, prox, adv, weights


def grads_after_update(model, batch, prox, adv, weights, actor_cfg):
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # keeps the weights, leaves the gradients
    metrics = update_policy(model, optimizer, batch, prox, adv, weights, decoupled_loss(actor_cfg), actor_cfg, 1.0)
    return {n: p.grad.clone() for n, p in model.named_parameters()}, metrics


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_accumulate_to_the_full_batch_gradient(setup, mode):
    model, batch, prox, adv, weights = setup
    whole_cfg = ActorConfig(micro_batch_size=B, loss_agg_mode=mode, grad_clip=0.0)
    micro_cfg = ActorConfig(micro_batch_size=3, loss_agg_mode=mode, grad_clip=0.0)
    whole, whole_metrics = grads_after_update(model, batch, prox, adv, weights, whole_cfg)
    micro, micro_metrics = grads_after_update(model, batch, prox, adv, weights, micro_cfg)

    # Reference: the loss of the whole batch written out directly.
    ref_model = copy.deepcopy(model)
    logits = ref_model(input_ids=batch.input_ids).logits[:, P - 1 : -1]
    logp = log_probs_from_logits(logits, batch.input_ids[:, P:])
    loss, ref_metrics = policy_loss(logp, prox, adv, batch.response_mask, weights=weights, loss_agg_mode=mode)
    loss.backward()
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(whole[name], p.grad, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(micro[name], p.grad, rtol=1e-4, atol=1e-6)
    assert micro_metrics["actor/pg_loss"] == pytest.approx(ref_metrics["actor/pg_loss"], rel=1e-5, abs=1e-7)
    assert micro_metrics["actor/ratio_max"] == pytest.approx(ref_metrics["actor/ratio_max"], rel=1e-6)
    assert micro_metrics["actor/ratio_min"] == pytest.approx(ref_metrics["actor/ratio_min"], rel=1e-6)


def test_shares_sum_to_one_for_mean_modes(setup):
    _, batch, *_ = setup
    mask = batch.response_mask
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        shares = [micro_batch_share(mode, mask[i : i + 4], mask) for i in range(0, B, 4)]
        assert sum(shares) == pytest.approx(1.0)
    with pytest.raises(KeyError, match="token-mean"):
        micro_batch_share("no-such-mode", mask, mask)


def test_non_finite_gradient_skips_the_step(setup):
    model, batch, prox, adv, weights = setup
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    adv = adv.clone()
    adv[0, 0] = float("inf")  # valid token: the loss rejects it
    cfg = ActorConfig(micro_batch_size=B)
    with pytest.raises(ValueError, match="advantages"):
        update_policy(model, optimizer, batch, prox, adv, weights, decoupled_loss(cfg), cfg, 1.0)
    model.lm_head.weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    metrics = update_policy(model, optimizer, batch, prox, torch.randn(B, R), weights, decoupled_loss(cfg), cfg, 1.0)
    assert metrics["actor/step_skipped"] == 1.0
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert not optimizer.state  # Adam moments were never touched
