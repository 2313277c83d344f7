"""actor.fsdp=always at world size 1: the same ActorRank, the policy wrapped by FSDP2 over a process group of one
(gloo, in this process); it must train exactly as the plain module does, with exact old log-probs."""

import pytest
import torch
import torch.distributed as dist

from dppo.trainer.ppo import PPOTrainer
from dppo.workers.actor.fsdp import is_sharded


def test_fsdp2_at_world_size_1_trains_as_the_plain_module_does(small_cfg):
    """(The other strategies allowed under FSDP2 are checked at world size 2: tests/integration/test_scale_out.py.)"""
    # score_ahead off: slot 0's reads under FSDP2 are under test (score-ahead at world size 2: test_scale_out.py)
    common = {
        "trainer.parameter_sync_step": 4,
        "trainer.train_batch_size": 8,
        "actor.lr": 0.05,
        "trainer.verify_old_log_prob": True,
        "actor.kl_loss_coef": 0.1,
        "snapshot.score_ahead": False,
    }
    plain = PPOTrainer(small_cfg(**common))
    plain_result = plain.fit()
    sharded = PPOTrainer(small_cfg(**common, **{"actor.fsdp": "always"}))
    rank = sharded.actor_group.local_rank
    assert is_sharded(rank.model) and is_sharded(rank.ref_model) and dist.is_initialized()
    try:
        result = sharded.fit()
    finally:
        sharded.close()  # leaves the process group even if fit() failed
    assert not dist.is_initialized()
    assert rank.pi_old.source.reader_name == "swap"  # auto's choice under FSDP2 (view on the plain module)
    assert [r["debug/old_log_prob_max_abs_diff"] for r in result.records] == [0.0, 0.0]
    for a, b in zip(plain_result.records, result.records, strict=True):
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "critic/score/mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key
    for name, value in plain.published.model().state_dict().items():  # the final weights, gathered from the shards
        torch.testing.assert_close(sharded.published.model().state_dict()[name], value, rtol=1e-6, atol=1e-7)
