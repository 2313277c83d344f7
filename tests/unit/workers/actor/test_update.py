"""The micro-batched optimizer step: accumulated gradients equal the gradient of the whole mini-batch's loss,
every term of it over the rejection-modified loss mask, in Decoupled PPO and in bypass mode."""

import copy

import pytest
import torch

from dppo.algo import (
    LOSS_AGG_MODES,
    RolloutCorrectionConfig,
    bypass_policy_loss,
    compute_rollout_correction_and_rejection_mask,
    entropy_bonus,
    entropy_from_logits,
    kl_loss,
    log_probs_from_logits,
    policy_loss,
)
from dppo.models import build_model
from dppo.batch import TrainBatch
from dppo.workers.actor.update import bypass_objective, decoupled_objective, update_policy
from dppo.config import ActorConfig, ModelConfig

P, R, V, B = 4, 5, 12, 11
TERMS = dict(entropy_coeff=0.01, kl_loss_coef=0.1, kl_loss_type="k3", grad_clip=0.0)
# Rejects a good part of the tokens of the batch below, and whole sequences through the seq option.
REJECTION = dict(rollout_rs="token_k1,seq_max_k2", rollout_rs_threshold="1.5,0.5")


@pytest.fixture
def setup():
    gen = torch.Generator().manual_seed(0)
    model_cfg = ModelConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    model = build_model(model_cfg, V, 1)
    mask = torch.rand(B, R, generator=gen) > 0.3
    mask[:, 0] = True
    mask[3] = False  # a sequence without valid tokens
    input_ids = torch.randint(0, V, (B, P + R), generator=gen)
    with torch.no_grad():  # behavior log-probs near the model's own, so that rejection keeps some tokens
        behav = log_probs_from_logits(model(input_ids=input_ids).logits[:, P - 1 : -1], input_ids[:, P:])
    behav = behav + 0.4 * torch.randn(B, R, generator=gen)
    batch = TrainBatch(
        input_ids=input_ids,
        response_mask=mask,
        behav_logp=behav,
        scores=torch.rand(B, generator=gen),
        group_index=torch.arange(B) // 3,
        versions=torch.zeros(4, dtype=torch.long),
    )
    prox = behav + 0.4 * torch.randn(B, R, generator=gen)
    adv = torch.randn(B, R, generator=gen)
    ref = behav + 0.2 * torch.randn(B, R, generator=gen)
    return model, batch, prox, adv, ref


def grads_after_update(model, batch, prox, adv, ref, actor_cfg, make_objective, rc):
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # keeps the weights, leaves the gradients
    objective = make_objective(actor_cfg, rc)(batch, prox, adv)
    metrics = update_policy(model, optimizer, batch, objective, actor_cfg, 1.0, ref)
    return {n: p.grad.clone() for n, p in model.named_parameters()}, {**objective.metrics, **metrics}


def reference_loss(model, batch, prox, adv, ref, actor_cfg, rc, bypass):
    """The whole mini-batch's loss written out directly: pg + entropy + KL over the loss mask."""
    logits = model(input_ids=batch.input_ids).logits[:, P - 1 : -1]
    logp = log_probs_from_logits(logits, batch.input_ids[:, P:])
    mode = actor_cfg.loss_agg_mode
    if bypass:
        _, keep, _ = compute_rollout_correction_and_rejection_mask(
            logp.detach(), batch.behav_logp, batch.response_mask, rc
        )
        pg, m = bypass_policy_loss(logp, batch.behav_logp, adv, batch.response_mask, rc, loss_agg_mode=mode)
    else:
        weights, keep, _ = compute_rollout_correction_and_rejection_mask(
            prox, batch.behav_logp, batch.response_mask, rc
        )
        pg, m = policy_loss(logp, prox, adv, keep, weights=weights, loss_agg_mode=mode)
    assert 0 < keep.sum() < batch.response_mask.sum()  # the case under test: some tokens rejected, not all
    bonus, em = entropy_bonus(entropy_from_logits(logits), keep, actor_cfg.entropy_coeff, mode)
    kl, km = kl_loss(logp, ref, keep, actor_cfg.kl_loss_coef, actor_cfg.kl_loss_type, mode)
    return pg + bonus + kl, {**m, **em, **km}


@pytest.mark.parametrize("bypass", [False, True], ids=["decoupled", "bypass"])
@pytest.mark.parametrize("mode", list(LOSS_AGG_MODES))
def test_micro_batches_accumulate_to_the_full_batch_gradient(setup, mode, bypass):
    model, batch, prox, adv, ref = setup
    rc = RolloutCorrectionConfig(rollout_is="token", bypass_mode=bypass, **REJECTION)
    make_objective = bypass_objective if bypass else decoupled_objective
    whole_cfg = ActorConfig(micro_batch_size=B, loss_agg_mode=mode, **TERMS)
    micro_cfg = ActorConfig(micro_batch_size=3, loss_agg_mode=mode, **TERMS)
    whole, whole_metrics = grads_after_update(model, batch, prox, adv, ref, whole_cfg, make_objective, rc)
    micro, micro_metrics = grads_after_update(model, batch, prox, adv, ref, micro_cfg, make_objective, rc)

    ref_model = copy.deepcopy(model)
    loss, ref_metrics = reference_loss(ref_model, batch, prox, adv, ref, whole_cfg, rc, bypass)
    loss.backward()
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(whole[name], p.grad, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(micro[name], p.grad, rtol=1e-4, atol=1e-6)
    for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/kl_coef", "actor/pg_clipfrac"):
        assert micro_metrics[key] == pytest.approx(ref_metrics[key], rel=1e-5, abs=1e-7), key
    assert micro_metrics["actor/ratio_max"] == pytest.approx(ref_metrics["actor/ratio_max"], rel=1e-6)
    assert micro_metrics["actor/ratio_min"] == pytest.approx(ref_metrics["actor/ratio_min"], rel=1e-6)
    assert micro_metrics["rollout_corr/token_rejected_frac"] > 0


def test_rejected_tokens_get_no_gradient_from_any_term(setup):
    # Regression (verl parity): rejection used to zero only the policy-gradient weight; the KL penalty and the
    # entropy bonus still pulled on rejected tokens. Reject every token: no term may leave a gradient.
    model, batch, prox, adv, ref = setup
    rc = RolloutCorrectionConfig(rollout_is="token", rollout_rs="token_k2", rollout_rs_threshold=1e-12)
    cfg = ActorConfig(micro_batch_size=3, **TERMS)
    grads, metrics = grads_after_update(model, batch, prox, adv, ref, cfg, decoupled_objective, rc)
    assert metrics["rollout_corr/token_rejected_frac"] == 1.0
    assert all(torch.count_nonzero(g) == 0 for g in grads.values())
    assert metrics["actor/pg_loss"] == metrics["actor/entropy"] == metrics["actor/kl_loss"] == 0.0


def test_non_finite_gradient_skips_the_step(setup):
    model, batch, prox, adv, _ = setup
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    adv = adv.clone()
    adv[0, 0] = float("inf")  # valid token: the loss rejects it
    cfg = ActorConfig(micro_batch_size=B)
    objective = decoupled_objective(cfg, RolloutCorrectionConfig(rollout_is="token"))
    with pytest.raises(ValueError, match="advantages"):
        update_policy(model, optimizer, batch, objective(batch, prox, adv), cfg, 1.0)
    model.lm_head.weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    metrics = update_policy(model, optimizer, batch, objective(batch, prox, torch.randn(B, R)), cfg, 1.0)
    assert metrics["actor/step_skipped"] == 1.0
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert not optimizer.state  # Adam moments were never touched


# ---- actor.max_ppo_kl: the guard -----------------------------------------------------------------------------------


def adam_state(optimizer) -> dict:
    return {i: {k: v.clone() for k, v in s.items()} for i, s in optimizer.state_dict()["state"].items()}


def test_a_mini_batch_past_the_kl_bound_takes_no_step_and_leaves_adam_as_it_was(setup):
    """prox shifted 1 above the setup's: the mini-batch's ppo_kl (mean of prox - logp) is well above 0.01 and below
    10. Above the bound nothing moves, Adam's moments and step count included (after one real step, so there is
    state to keep); below it the step is taken."""
    model, batch, prox, adv, _ = setup
    prox = prox + 1.0
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    rc = RolloutCorrectionConfig(rollout_is="token")
    loose, tight = ActorConfig(micro_batch_size=4, max_ppo_kl=10.0), ActorConfig(micro_batch_size=4, max_ppo_kl=0.01)
    stepped = update_policy(model, optimizer, batch, decoupled_objective(loose, rc)(batch, prox, adv), loose, 1.0)
    assert stepped["actor/skipped_updates"] == 0.0 and 0.01 < stepped["actor/ppo_kl"] < 10.0
    before, state = {n: p.detach().clone() for n, p in model.named_parameters()}, adam_state(optimizer)
    assert all(int(s["step"]) == 1 for s in state.values())
    skipped = update_policy(model, optimizer, batch, decoupled_objective(tight, rc)(batch, prox, adv), tight, 1.0)
    assert skipped["actor/skipped_updates"] == 1.0 and skipped["actor/ppo_kl"] > 0.01
    assert skipped["actor/step_skipped"] == 0.0  # the gradient was fine: the guard, not the non-finite check
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
        assert p.grad is None, n  # zeroed: nothing left for a later step to apply
    after = adam_state(optimizer)
    assert after.keys() == state.keys()
    for i, tensors in state.items():
        for key, value in tensors.items():
            assert torch.equal(after[i][key], value), (i, key)
    assert "actor/skipped_updates" not in update_policy(
        model,
        optimizer,
        batch,  # the guard off: no such metric
        decoupled_objective(ActorConfig(micro_batch_size=4), rc)(batch, prox, adv),
        ActorConfig(micro_batch_size=4),
        1.0,
    )


class TwoRanks:
    """A RankGroup stand-in for rank 0 of two: the other rank's value is added in every sum."""

    world_size = 2

    def __init__(self, other: float) -> None:
        self.other = other

    def all_reduce_sum(self, tensor):
        return tensor + self.other


def test_the_guard_compares_the_kl_summed_over_the_ranks_shares():
    from dppo.workers.actor.update import past_kl_bound

    # this rank's share 0.3 alone is within 0.5; with the other rank's 0.4 the mini-batch's ppo_kl_k3 is 0.7
    assert past_kl_bound({"actor/ppo_kl_k3": 0.3}, 0.5, TwoRanks(0.4))
    assert not past_kl_bound({"actor/ppo_kl_k3": 0.3}, 0.5, TwoRanks(0.1))
    assert past_kl_bound({}, 0.5, TwoRanks(0.6))  # a rank without valid tokens has no share, and decides alike
    assert past_kl_bound({"actor/ppo_kl_k3": float("nan")}, 0.5, TwoRanks(0.0))  # NaN: something broke; no step
    assert not past_kl_bound({"actor/ppo_kl_k3": 0.5}, 0.5, TwoRanks(0.0))  # at the bound: within it
