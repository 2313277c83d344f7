"""algorithm.use_kl_in_reward: the trigger's scores minus beta x KL(live policy || reference) per valid token
before the advantages, verl's controllers for beta, and the metrics verl names."""

import pytest
import torch

from dppo.algo import kl_penalty
from dppo.config import ConfigError, load_config
from dppo.trainer.ppo import PPOTrainer
from tests.unit.workers.actor.test_prox_method import make_batch

KL = {"algorithm.use_kl_in_reward": True, "algorithm.kl_penalty": "low_var_kl", "algorithm.kl_ctrl.kl_coef": 0.5}


def test_the_scores_lose_beta_times_each_sequences_kl_to_the_reference(small_cfg):
    trainer = PPOTrainer(small_cfg(**KL))
    rank = trainer.actor_group.local_rank
    with torch.no_grad():  # move the policy away from the reference (the initial weights)
        for p in rank.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch, _ = make_batch(rank.model)
    scores, metrics = trainer.kl_in_reward(batch)
    live, ref = rank.score(rank.model, batch), rank.score(rank.ref_model, batch)
    kld = kl_penalty(live, ref, "low_var_kl", response_mask=batch.response_mask)  # (B, R)
    assert float(kld.abs().max()) > 1e-3  # the policy moved: the penalty is there
    torch.testing.assert_close(scores, batch.scores - 0.5 * kld.sum(-1), rtol=1e-5, atol=1e-6)
    per_seq = kld.sum(-1) / (batch.response_mask.sum(-1) + 1e-8)
    assert metrics == {
        "actor/reward_kl_penalty": pytest.approx(float(per_seq.mean())),
        "actor/reward_kl_penalty_coeff": 0.5,
    }
    trainer.close()


def test_a_sync_run_with_the_adaptive_controller_trains_and_logs(small_cfg):
    cfg = small_cfg(**{**KL, "algorithm.kl_ctrl.type": "adaptive", "algorithm.kl_ctrl.horizon": 20})
    records = PPOTrainer(cfg).fit().records
    kls = [r["actor/reward_kl_penalty"] for r in records]
    coefs = [r["actor/reward_kl_penalty_coeff"] for r in records]
    assert 0 <= kls[0] < kls[-1]  # the first trigger's policy is the reference: the KL grows from 0
    assert 0.5 >= coefs[0] > coefs[-1]  # KL below target_kl (0.1): the adaptive beta falls from kl_coef
    assert all(r["actor/grad_norm"] > 0 for r in records)


def test_estimators_that_read_token_level_rewards_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="adv_estimator='reinforce_plus_plus': that estimator reads the rewards"):
        load_config(["algorithm.use_kl_in_reward=true", "algorithm.adv_estimator=reinforce_plus_plus"])


def test_the_adaptive_coefficient_is_in_checkpoints_and_resumes(small_cfg):
    adaptive = {
        **KL,
        "algorithm.kl_ctrl.type": "adaptive",
        "algorithm.kl_ctrl.horizon": 20,
        "trainer.checkpoint_every": 1,
    }
    trainer = PPOTrainer(small_cfg(**adaptive, **{"trainer.total_steps": 1}))
    trainer.fit()
    moved = trainer.kl_ctrl.value
    assert moved != 0.5
    resumed = PPOTrainer(small_cfg(**adaptive, **{"trainer.total_steps": 2, "trainer.resume": True}))
    assert resumed.resumed_from is not None and resumed.kl_ctrl.value == moved
    resumed.close()
