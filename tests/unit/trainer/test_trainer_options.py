"""Each documented option runs a real cycle and produces finite metrics (in-process, one global step)."""

import math
from types import SimpleNamespace

import pytest

import torch

from dppo.algo import bypass_policy_loss
from dppo.trainer.ppo import PPOTrainer


@pytest.mark.parametrize(
    "options",
    [
        {"algorithm.rollout_correction.bypass_mode": True, "algorithm.rollout_correction.loss_type": "reinforce"},
        {"algorithm.adv_estimator": "rloo", "actor.entropy_coeff": 0.01, "actor.kl_loss_coef": 0.1},
        {
            "algorithm.rollout_correction.rollout_is": "sequence",
            "algorithm.rollout_correction.rollout_rs": "token_k1",
            "algorithm.rollout_correction.rollout_rs_threshold": 2.0,
            "algorithm.rollout_correction.rollout_is_batch_normalize": True,
        },
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


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_any_local_causal_lm_directory(small_cfg, tmp_path, arch):
    """model.path takes any transformers causal LM saved on disk; workers rebuild it from its config."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    if arch == "llama":
        config = LlamaConfig(
            vocab_size=16,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=64,
        )
    else:
        config = GPT2Config(vocab_size=16, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / arch)
    trainer = PPOTrainer(small_cfg(**{"model.path": str(tmp_path / arch), "trainer.total_steps": 1}))
    assert trainer.model_config.model_type == arch and trainer.actor_group.local_rank.model.config.model_type == arch
    result = trainer.fit()
    assert math.isfinite(result.records[0]["actor/pg_loss"])
    assert result.records[0]["rollout_corr/kl_k1"] == pytest.approx(0.0, abs=1e-6)  # sync: behavior == old policy


def test_bypass_ppo_clip_logs_how_far_pi_theta_drifted_from_pi_behav(small_cfg):
    """pi_old := pi_behav there, so pi_old / pi_behav is 1; rollout_corr/* compare pi_theta with pi_behav instead (as
    verl does), and the loss is bypass_policy_loss: the unweighted PPO loss against pi_behav over the tokens that
    rejection sampling (on pi_theta / pi_behav) keeps."""
    key = "algorithm.rollout_correction"
    cfg = small_cfg(
        **{
            f"{key}.bypass_mode": True,
            f"{key}.rollout_rs": "token_k1",
            f"{key}.rollout_rs_threshold": 1.5,
            "trainer.total_steps": 1,
            "actor.lr": 0.05,
        }
    )
    trainer = PPOTrainer(cfg)
    gen = torch.Generator().manual_seed(0)
    logp, behav_logp = -torch.rand(3, 4, generator=gen), -torch.rand(3, 4, generator=gen)  # (B, R)
    advantages = torch.randn(3, 4, generator=gen)
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[0, 3] = False
    batch = SimpleNamespace(behav_logp=behav_logp, response_mask=mask)
    rank = trainer.actor_group.local_rank
    objective = rank.objective(batch, None, advantages)
    assert objective.loss_mask is None  # rejection on pi_theta: known per micro-batch only
    loss, loss_mask, metrics = objective.pg_loss(logp, slice(0, 3), None)
    a = cfg.actor
    ref_loss, ref_metrics = bypass_policy_loss(
        logp,
        behav_logp,
        advantages,
        mask,
        rank.rollout_correction,
        clip_ratio_low=a.clip_ratio_low,
        clip_ratio_high=a.clip_ratio_high,
        clip_ratio_c=a.clip_ratio_c,
    )
    assert loss.item() == ref_loss.item() and metrics == ref_metrics
    assert 0 < loss_mask.sum() < mask.sum() and ref_metrics["rollout_corr/kl_k3"] > 0

    record = trainer.fit().records[0]
    # Trigger 0 trains the policy that sampled (drift 0); trigger 1 a policy one optimizer step further.
    assert record["rollout_corr/kl_k3"] > 0 and record["rollout_corr/weight_mean"] > 0
