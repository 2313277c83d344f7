"""Shared inputs of the oracle tests: random batches that verl's functions accept (finite everywhere, at least
one valid token), and verl's config objects built the way verl's trainer builds them."""

import pytest
import torch


def random_batch(seed: int, b: int = 8, t: int = 12, spread: float = 0.5):
    """old_log_prob, rollout_log_prob (B, T) and a bool mask with a fully masked row and ragged lengths."""
    gen = torch.Generator().manual_seed(seed)
    old = -3.0 * torch.rand(b, t, generator=gen)
    rollout = old + spread * torch.randn(b, t, generator=gen)
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = torch.arange(t)[None, :] < lengths[:, None]  # (B, T): right padding, as responses are
    mask &= torch.rand(b, t, generator=gen) > 0.15  # and holes, as a multi-turn loss mask has
    mask[1] = False  # a sequence without valid tokens
    mask[0, 0] = True
    return old, rollout, mask


@pytest.fixture
def batch():
    return random_batch


@pytest.fixture
def verl_actor_config():
    """verl's ActorConfig for the policy losses, with dppo's defaults for the clip settings."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.workers.config import ActorConfig, PolicyLossConfig

    def make(loss_agg_mode="token-mean", global_batch_info=None, rollout_correction=None, **clip):
        policy_loss = PolicyLossConfig()
        if rollout_correction is not None:  # bypass mode: verl's apply_bypass_mode sets these two
            # verl's YAML default rollout_is is null (its dataclass says "sequence"; the trainer reads the YAML)
            rc = RolloutCorrectionConfig(**{"rollout_is": None, **rollout_correction})
            policy_loss = PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=rc)
        return ActorConfig(
            strategy="fsdp",
            rollout_n=1,
            ppo_micro_batch_size_per_gpu=1,
            loss_agg_mode=loss_agg_mode,
            policy_loss=policy_loss,
            global_batch_info=dict(global_batch_info or {}),
            **{"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0, **clip},
        )

    return make
