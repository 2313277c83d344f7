"""Each documented option runs a real cycle and produces finite metrics (in-process, one global step)."""

import math

import pytest

from dppo.trainer.ppo import PPOTrainer


@pytest.mark.parametrize(
    "options",
    [
        {"algorithm.rollout_correction.bypass_mode": True, "algorithm.rollout_correction.loss_type": "reinforce"},
        {"algorithm.adv_estimator": "rloo", "actor.entropy_coeff": 0.01, "actor.kl_loss_coef": 0.1},
        {"algorithm.rollout_correction.rollout_is": "sequence", "algorithm.rollout_correction.rollout_rs": "token_k1",
         "algorithm.rollout_correction.rollout_rs_threshold": 2.0},
        {"algorithm.prox_anchor": "current", "trainer.verify_old_log_prob": True},
        {"replay.max_off_policy_strategy": "drop", "replay.max_off_policy_threshold": 0},
        {"task.name": "sort", "rollout.max_new_tokens": 4, "actor.loss_agg_mode": "seq-mean-token-mean"},
        {"task.name": "reverse", "algorithm.norm_adv_by_std_in_grpo": False, "rollout.temperature": 0.7},
    ],
    ids=["bypass-reinforce", "rloo-entropy-kl", "seq-is-rs", "current-verify", "drop", "sort", "reverse"],
)
def test_option_runs_a_cycle(small_cfg, options):
    result = PPOTrainer(small_cfg(**{"trainer.total_steps": 1, **options})).fit()
    record = result.records[0]
    assert record["step"] == 1
    for key, value in record.items():
        assert math.isfinite(value), key
    if options.get("trainer.verify_old_log_prob"):
        assert record["debug/old_log_prob_max_abs_diff"] == 0.0
    if options.get("actor.kl_loss_coef"):
        assert "actor/kl_loss" in record and "actor/entropy" in record
    if "rollout.max_new_tokens" in options:
        assert record["response_length/mean"] == options["rollout.max_new_tokens"]
    assert 0.0 <= result.evaluation["eval/reward"] <= 1.0
