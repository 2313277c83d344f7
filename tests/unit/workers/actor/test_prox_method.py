"""Where log pi_prox comes from: the training forward pass where pi_old is the live weights (no pass of its own,
the same update as with one), loglinear's approximation (no snapshot, no pass), and metrics' measured error."""

import copy

import pytest
import torch

import dppo.snapshot
import dppo.workers.actor.update
from dppo.algo import loglinear_prox_log_prob
from dppo.batch import TrainBatch
from dppo.trainer.ppo import PPOTrainer
from dppo.workers.actor.loss_choice import LossChoice
from dppo.config.pi_old import choose_pi_old
from dppo.trainer.worker_group import actor_settings
from dppo.workers.actor.rank import ActorRank

P, R, V, B = 3, 5, 12, 11
# Rejects a good part of the tokens of the batch below, and whole sequences through the seq option.
REJECTION = {
    "algorithm.rollout_correction.rollout_rs": "token_k1,seq_max_k2",
    "algorithm.rollout_correction.rollout_rs_threshold": "1.5,0.5",
}


def make_rank(small_cfg, **extra) -> ActorRank:
    cfg = small_cfg(**{"actor.lr": 0.01, "actor.micro_batch_size": 4, **extra})
    rank = ActorRank(actor_settings(cfg), choose_pi_old(cfg), 0, 1, V)
    rank.init_model(*rank.master_address())
    return rank


def make_batch(model, versions=(0, 0, 0, 0)) -> tuple[TrainBatch, torch.Tensor]:
    """B sequences in 4 groups (versions: each group's policy version), a sequence without valid tokens, behavior
    log-probs near the model's own (so that rejection keeps some tokens), and advantages."""
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, V, (B, P + R), generator=gen)
    mask = torch.rand(B, R, generator=gen) > 0.3
    mask[:, 0] = True
    mask[3] = False
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits[:, P - 1 : -1]
        behav = torch.log_softmax(logits.float(), -1).gather(-1, input_ids[:, P:, None])[..., 0]
    batch = TrainBatch(
        input_ids=input_ids,
        response_mask=mask,
        behav_logp=behav + 0.3 * torch.randn(B, R, generator=gen),
        scores=torch.rand(B, generator=gen),
        group_index=torch.arange(B) // 3,
        versions=torch.tensor(versions),
    )
    return batch, torch.randn(B, R, generator=gen)


def count_forwards(model) -> list:
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls


def params(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def capture_prox_of_loss(monkeypatch) -> list[torch.Tensor]:
    """Every old_log_prob (b, R) that reaches the policy loss, micro-batch by micro-batch."""
    seen, inner = [], LossChoice.pg_loss

    def pg_loss(self, logp, old_log_prob, *args, **kwargs):
        seen.append(old_log_prob.detach().clone())
        return inner(self, logp, old_log_prob, *args, **kwargs)

    monkeypatch.setattr(LossChoice, "pg_loss", pg_loss)
    return seen


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("anchor", ["cycle_start", "current"])
def test_live_pi_old_from_the_training_forward_updates_as_a_separate_pass(small_cfg, mode, anchor):
    """Trigger 0 (cycle_start) and every trigger of current: no old-log-prob pass, the same weights and metrics."""
    results = {}
    for fuse in (True, False):
        rank = make_rank(small_cfg, **{"actor.loss_agg_mode": mode, "algorithm.prox_anchor": anchor, **REJECTION})
        rank.pi_old.source.fuse_live = fuse  # False: the no-grad pass of before (IS batch normalization's fallback)
        batch, adv = make_batch(rank.model)
        forwards = count_forwards(rank.model)
        metrics = [rank.update_actor(k, batch, adv, 0) for k in range(2 if anchor == "current" else 1)]
        grads = {name: p.grad.clone() for name, p in rank.model.named_parameters()}  # the last step's
        results[fuse] = params(rank.model), grads, metrics, len(forwards)
        rank.close()
    (fused, fused_grads, fused_metrics, fused_forwards) = results[True]
    (separate, separate_grads, separate_metrics, separate_forwards) = results[False]
    micro_batches = -(-B // 4)
    assert fused_forwards == micro_batches * len(fused_metrics)  # the training forward passes only
    assert separate_forwards == 2 * micro_batches * len(fused_metrics)
    for name, value in separate_grads.items():
        torch.testing.assert_close(fused_grads[name], value, rtol=1e-5, atol=1e-7)
    # Adam's first steps move every weight by about lr = 0.01 whatever the gradient's size, so a gradient of
    # ~1e-8 that differs in its last bits moves its weight by ~1e-6 more or less: within 1e-3 of a step
    for name, value in separate.items():
        torch.testing.assert_close(fused[name], value, rtol=0, atol=1e-5)
    for got, want in zip(fused_metrics, separate_metrics):
        assert 0 < got["rollout_corr/token_rejected_frac"] < 1  # the case under test: some tokens rejected
        for key, value in want.items():
            if not key.startswith("timing_s/"):
                assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_is_batch_normalization_keeps_the_separate_pass(small_cfg):
    rank = make_rank(small_cfg, **{"algorithm.rollout_correction.rollout_is_batch_normalize": True})
    batch, adv = make_batch(rank.model)
    assert rank.pi_old.source.fuse_live is False
    assert rank.pi_old.source.compute(0, batch) is not None
    metrics = rank.update_actor(0, batch, adv, 0)
    assert metrics["rollout_corr/weight_mean"] == pytest.approx(1.0, rel=1e-5)  # normalized over the mini-batch
    rank.close()


def test_loglinear_prox_in_the_loss_is_loglinear_prox_log_prob(small_cfg, monkeypatch):
    monkeypatch.setattr(dppo.snapshot, "SnapshotPool", None)  # loglinear must make no pool at all
    rank = make_rank(
        small_cfg,
        **{"algorithm.prox_logp_method": "loglinear", "trainer.parameter_sync_step": 4, "trainer.train_batch_size": 8},
    )
    assert rank.pi_old.source.pool is None and rank.pi_old.source.name == "none"
    batch, adv = make_batch(rank.model, versions=(1, 2, 3, 3))  # optimizer steps 4, 8, 12, 12
    theta = rank.score(copy.deepcopy(rank.model), batch)  # (B, R) log pi_theta before the step, independently
    seen = capture_prox_of_loss(monkeypatch)
    forwards = count_forwards(rank.model)
    rank.update_actor(2, batch, adv, 3)  # v_prox = 12, v_theta = 14
    expected = loglinear_prox_log_prob(
        theta,
        batch.behav_logp,
        batch.response_mask,
        v_prox=12,
        v_theta=14,
        v_behav=torch.tensor([4, 8, 12, 12])[batch.group_index],
    )
    used = torch.cat(seen)
    mask = batch.response_mask
    torch.testing.assert_close(used[mask], expected[mask], rtol=0, atol=0)
    assert len(forwards) == 3  # the training forward's micro-batches, nothing else
    # alpha 0.8 and 2/3 for the older groups, 0 for the newest: pi_prox is neither pi_behav nor pi_theta there
    old_rows = mask & (batch.group_index < 2)[:, None]
    assert not torch.allclose(used[old_rows], batch.behav_logp[old_rows])
    assert not torch.allclose(used[old_rows], theta[old_rows])
    new_rows = mask & (batch.group_index >= 2)[:, None]
    torch.testing.assert_close(used[new_rows], batch.behav_logp[new_rows], rtol=0, atol=0)
    rank.close()


def test_loglinear_takes_each_tokens_own_behavior_version(small_cfg, monkeypatch):
    """rollout.partial_rollout: a response started at version 1 and finished at version 3 interpolates its early
    tokens with alpha (12 - 4) / (14 - 4) and takes pi_behav on its late ones (sampled by pi_prox's weights): the
    per-token versions reach the loss, not the response's start version for every token."""
    rank = make_rank(
        small_cfg,
        **{"algorithm.prox_logp_method": "loglinear", "trainer.parameter_sync_step": 4, "trainer.train_batch_size": 8},
    )
    batch, adv = make_batch(rank.model, versions=(1, 2, 3, 3))
    token_versions = batch.versions[batch.group_index][:, None].repeat(1, R)  # (B, R)
    token_versions[:6, 2:] = 3  # groups 0 and 1: their tokens from position 2 on were sampled by version 3
    batch.token_versions = token_versions
    theta = rank.score(copy.deepcopy(rank.model), batch)
    seen = capture_prox_of_loss(monkeypatch)
    rank.update_actor(2, batch, adv, 3)  # v_prox = 12, v_theta = 14
    expected = loglinear_prox_log_prob(
        theta, batch.behav_logp, batch.response_mask, v_prox=12, v_theta=14, v_behav=token_versions * 4
    )
    used, mask = torch.cat(seen), batch.response_mask
    torch.testing.assert_close(used[mask], expected[mask], rtol=0, atol=0)
    late = mask.clone()
    late[6:], late[:, :2] = False, False
    assert late.any()
    torch.testing.assert_close(used[late], batch.behav_logp[late], rtol=0, atol=0)  # alpha 0: as new as pi_prox
    early = mask.clone()
    early[6:], early[:, 2:] = False, False
    assert not torch.allclose(used[early], batch.behav_logp[early])  # interpolated: sampled before pi_prox
    rank.close()


def test_loglinear_counts_only_the_updates_applied_in_the_cycle(small_cfg, monkeypatch):
    """actor.max_ppo_kl skips trigger 1's update: the weights stay where trigger 0 left them, so trigger 2 is one
    applied step past pi_prox, v_theta = 12 + 1, not 12 + 2. The count is part of pi_old's checkpointed state, and
    the next cycle starts from none skipped."""
    rank = make_rank(
        small_cfg,
        **{
            "algorithm.prox_logp_method": "loglinear",
            "trainer.parameter_sync_step": 4,
            "trainer.train_batch_size": 8,
            "actor.max_ppo_kl": 0.5,
        },
    )
    batch, adv = make_batch(rank.model, versions=(1, 2, 3, 3))
    guard, calls = dppo.workers.actor.update.past_kl_bound, []

    def skip_trigger_1(metrics, bound, peers):
        calls.append(bound)
        return len(calls) == 2 or guard(metrics, bound, peers)

    monkeypatch.setattr(dppo.workers.actor.update, "past_kl_bound", skip_trigger_1)
    rank.update_actor(0, batch, adv, 3)
    before_skip = params(rank.model)
    assert rank.update_actor(1, batch, adv, 3)["actor/skipped_updates"] == 1.0
    assert all(torch.equal(p, before_skip[name]) for name, p in params(rank.model).items())  # nothing moved
    theta = rank.score(copy.deepcopy(rank.model), batch)
    seen = capture_prox_of_loss(monkeypatch)
    assert rank.update_actor(2, batch, adv, 3)["actor/skipped_updates"] == 0.0
    expected = loglinear_prox_log_prob(
        theta,
        batch.behav_logp,
        batch.response_mask,
        v_prox=12,
        v_theta=13,
        v_behav=torch.tensor([4, 8, 12, 12])[batch.group_index],
    )
    used, mask = torch.cat(seen), batch.response_mask
    torch.testing.assert_close(used[mask], expected[mask], rtol=0, atol=0)
    state = rank.pi_old_state()
    assert state["skipped"] == 1
    resumed = make_rank(
        small_cfg,
        **{"algorithm.prox_logp_method": "loglinear", "trainer.parameter_sync_step": 4, "trainer.train_batch_size": 8},
    )
    resumed.load_pi_old_state(state)
    assert resumed.pi_old.prox(3, batch, 3).steps.v_theta == 12 + 3 - 1
    assert resumed.pi_old.prox(0, batch, 4).steps.v_theta == 16  # a new cycle: none skipped yet
    rank.close()
    resumed.close()


def test_metrics_reports_loglinear_error_against_the_exact_prox(small_cfg):
    rank = make_rank(
        small_cfg,
        **{
            "algorithm.prox_logp_method": "metrics",
            "trainer.parameter_sync_step": 4,
            "trainer.train_batch_size": 8,
            "actor.lr": 0.05,
        },
    )
    batch, adv = make_batch(rank.model, versions=(0, 1, 1, 1))
    anchor = copy.deepcopy(rank.model)  # pi_prox: the cycle-start weights (version 1, step 4)
    rank.update_actor(0, batch, adv, 1)
    rank.update_actor(1, batch, adv, 1)
    theta = rank.score(copy.deepcopy(rank.model), batch)  # log pi_theta at trigger 2, independently
    metrics = rank.update_actor(2, batch, adv, 1)
    exact = rank.score(anchor, batch)
    mask = batch.response_mask
    # group 0 (step 0): alpha = (4 - 0) / (6 - 0); the others (step 4) take pi_behav
    alpha = torch.where(batch.group_index == 0, 4 / 6, 0.0)[:, None]
    approx = batch.behav_logp + alpha * (theta - batch.behav_logp)
    err = (approx - exact).abs()[mask]
    w_err = (torch.exp(approx - batch.behav_logp) - torch.exp(exact - batch.behav_logp)).abs()[mask]
    assert float(err.max()) > 1e-3  # the weights moved: the approximation is off, and measurably so
    assert metrics["prox_approx/abs_err_mean"] == pytest.approx(float(err.mean()), rel=1e-4)
    assert metrics["prox_approx/abs_err_max"] == pytest.approx(float(err.max()), rel=1e-4)
    assert metrics["prox_approx/is_weight_abs_err_mean"] == pytest.approx(float(w_err.mean()), rel=1e-4)
    assert metrics["prox_approx/is_weight_abs_err_max"] == pytest.approx(float(w_err.max()), rel=1e-4)
    # only group 0's tokens are interpolated (0 < alpha < 1); at trigger 0 none is (alpha is 1 or 0 there)
    assert metrics["prox_approx/interp_frac"] == pytest.approx(float(mask[batch.group_index == 0].sum() / mask.sum()))
    assert rank.update_actor(0, batch, adv, 2)["prox_approx/interp_frac"] == 0.0
    rank.close()


def test_loglinear_and_metrics_runs_train_and_log(small_cfg):
    for method in ("loglinear", "metrics"):
        result = PPOTrainer(small_cfg(**{"algorithm.prox_logp_method": method})).fit()
        keys = set(result.records[-1])
        assert ("prox_approx/abs_err_mean" in keys) == (method == "metrics"), method
        assert all(r["actor/grad_norm"] > 0 for r in result.records)
