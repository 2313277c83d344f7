"""actor.max_ppo_kl in a whole (in-process) run: a planted bad update (lr 10 for one optimizer step) is caught. The
step itself is trigger 0's, where pi_old is the live weights (ppo_kl 0); the cycle's later triggers measure how far
it moved the policy, and are skipped: the weights and Adam's state stay those the bad step left, each skip is
counted and logged in one line. The same run without the guard applies them."""

from __future__ import annotations

import logging

import pytest
import torch

from dppo.config import ConfigError
from dppo.trainer.ppo import PPOTrainer

PS = 3
BAD = (1, 0)  # (global steps done, trigger): step 2's trigger 0


def state_of(rank) -> tuple[dict, dict]:
    """The rank's weights and Adam state (moments, step counts), copied."""
    weights = {k: v.clone() for k, v in rank.model.state_dict().items()}
    adam = {i: {k: v.clone() for k, v in s.items()} for i, s in rank.optimizer.state_dict()["state"].items()}
    return weights, adam


def planted_run(small_cfg, monkeypatch, **extra):
    """A run whose step 2 starts with one optimizer step at lr 10; (trainer, the rank's state right after that step,
    and before each later trigger of step 2)."""
    cfg = small_cfg(**{"trainer.parameter_sync_step": PS, "trainer.train_batch_size": 2 * PS, **extra})
    train_trigger, states = PPOTrainer.train_trigger, []

    def planting(self, batch, prox_logp=None):
        rank = self.actor_group.local_rank
        if (self.global_step, self.local_trigger_step) == BAD:
            rank.optimizer.param_groups[0]["lr"] = 10.0  # the lr schedule sets it back after the step
        metrics = train_trigger(self, batch, prox_logp)
        if self.global_step == BAD[0]:
            states.append(state_of(rank))
        return metrics

    monkeypatch.setattr(PPOTrainer, "train_trigger", planting)
    trainer = PPOTrainer(cfg)
    trainer.fit()
    return trainer, states


def assert_same(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    for name, tensor in a[0].items():
        assert torch.equal(tensor, b[0][name]), name
    assert a[1].keys() == b[1].keys()
    for index, tensors in a[1].items():
        for key, value in tensors.items():
            assert torch.equal(value, b[1][index][key]), (index, key)


def test_a_planted_bad_update_is_caught_and_the_cycles_later_steps_are_not_taken(small_cfg, monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="dppo.trainer"):
        trainer, states = planted_run(small_cfg, monkeypatch, **{"actor.max_ppo_kl": 0.1})
    records = trainer.metrics.records
    assert [r["actor/skipped_updates"] for r in records] == [0.0, 2.0]  # step 2's triggers 1 and 2
    assert records[0]["actor/ppo_kl"] < 0.1 < records[1]["actor/ppo_kl"]
    after_bad, after_1, after_2 = states
    assert_same(after_1, after_bad)
    assert_same(after_2, after_bad)  # the run ends with the weights and Adam state the bad step left, no worse
    lines = [r.getMessage() for r in caplog.records if r.name == "dppo.trainer"]
    assert len(lines) == 2
    for trigger, line in zip((1, 2), lines):
        assert line.startswith(f"step 2, trigger {trigger}: actor/ppo_kl=") and line.endswith(
            " > actor.max_ppo_kl=0.1; the update was skipped (weights and optimizer state unchanged)"
        )
        assert float(line.split("actor/ppo_kl=")[1].split(" ")[0]) > 0.1


def test_without_the_guard_the_same_run_applies_them(small_cfg, monkeypatch):
    trainer, (after_bad, after_1, after_2) = planted_run(small_cfg, monkeypatch)
    assert "actor/skipped_updates" not in trainer.metrics.records[-1]
    assert any(not torch.equal(after_2[0][name], t) for name, t in after_bad[0].items())  # the weights moved on
    assert all(int(s["step"]) == int(after_bad[1][i]["step"]) + 2 for i, s in after_2[1].items())


def test_the_guard_is_refused_where_ppo_kl_is_always_0(small_cfg):
    with pytest.raises(
        ConfigError,
        match=r"^actor.max_ppo_kl=0.1 guards on actor/ppo_kl, which algorithm.prox_anchor="
        r"current makes 0 at every trigger",
    ):
        small_cfg(**{"actor.max_ppo_kl": 0.1, "algorithm.prox_anchor": "current"})
    with pytest.raises(ConfigError, match=r"which trainer.parameter_sync_step=1 makes 0"):
        small_cfg(**{"actor.max_ppo_kl": 0.1, "trainer.parameter_sync_step": 1})
    bypass = small_cfg(
        **{"actor.max_ppo_kl": 0.1, "trainer.parameter_sync_step": 1, "algorithm.rollout_correction.bypass_mode": True}
    )  # ppo_kl against pi_behav
    assert bypass.actor.max_ppo_kl == 0.1
