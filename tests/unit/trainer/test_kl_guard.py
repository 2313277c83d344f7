"""actor.max_ppo_kl in a whole (in-process) run: a planted bad update (lr 10 for one optimizer step) is caught. The
step itself is trigger 0's, where pi_old is the live weights (ppo_kl_k3 0); the cycle's later triggers measure how far
it moved the policy, and are skipped: the weights and Adam's state stay those the bad step left, each skip is
counted and logged in one line. The same run without the guard applies them. The guard's measure is k3's, never
negative: a mini-batch whose signed ppo_kl is 0 or below while the policy moved is caught too."""

from __future__ import annotations

import logging

import pytest
import torch

from dppo.batch import TrainBatch
from dppo.config import ConfigError
from dppo.trainer.ppo import PPOTrainer
from dppo.config.pi_old import choose_pi_old
from dppo.trainer.worker_group import actor_settings
from dppo.workers.actor.rank import ActorRank

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
    assert records[0]["actor/ppo_kl_k3"] < 0.1 < records[1]["actor/ppo_kl_k3"]
    after_bad, after_1, after_2 = states
    assert_same(after_1, after_bad)
    assert_same(after_2, after_bad)  # the run ends with the weights and Adam state the bad step left, no worse
    lines = [r.getMessage() for r in caplog.records if r.name == "dppo.trainer"]
    assert len(lines) == 2
    for trigger, line in zip((1, 2), lines):
        assert line.startswith(f"step 2, trigger {trigger}: actor/ppo_kl_k3=") and line.endswith(
            " > actor.max_ppo_kl=0.1; the update was skipped (weights and optimizer state unchanged)"
        )
        assert float(line.split("actor/ppo_kl_k3=")[1].split(" ")[0]) > 0.1


def test_without_the_guard_the_same_run_applies_them(small_cfg, monkeypatch):
    trainer, (after_bad, after_1, after_2) = planted_run(small_cfg, monkeypatch)
    assert "actor/skipped_updates" not in trainer.metrics.records[-1]
    assert any(not torch.equal(after_2[0][name], t) for name, t in after_bad[0].items())  # the weights moved on
    assert all(int(s["step"]) == int(after_bad[1][i]["step"]) + 2 for i, s in after_2[1].items())


def test_the_guard_is_refused_where_ppo_kl_is_always_0(small_cfg):
    with pytest.raises(
        ConfigError,
        match=r"^actor.max_ppo_kl=0.1 guards on actor/ppo_kl_k3, which algorithm.prox_anchor="
        r"current makes 0 at every trigger",
    ):
        small_cfg(**{"actor.max_ppo_kl": 0.1, "algorithm.prox_anchor": "current"})
    with pytest.raises(ConfigError, match=r"which trainer.parameter_sync_step=1 makes 0"):
        small_cfg(**{"actor.max_ppo_kl": 0.1, "trainer.parameter_sync_step": 1})
    bypass = small_cfg(
        **{"actor.max_ppo_kl": 0.1, "trainer.parameter_sync_step": 1, "algorithm.rollout_correction.bypass_mode": True}
    )  # ppo_kl against pi_behav
    assert bypass.actor.max_ppo_kl == 0.1


def moved_batch(rank: ActorRank, shift: str) -> tuple[TrainBatch, torch.Tensor]:
    """A batch of 6 sequences of 4 response tokens and log pi_old (B, R) moved from the rank's pi_theta by -0.5 on
    every valid token (shift minus_half), or alternately by +1 and -1 (alternating: the signed sum 0)."""
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 12, (6, 7), generator=gen)
    mask = torch.rand(6, 4, generator=gen) > 0.3
    mask[:, 0] = True
    batch = TrainBatch(
        input_ids=input_ids,
        response_mask=mask,
        behav_logp=torch.zeros(6, 4),
        scores=torch.rand(6, generator=gen),
        group_index=torch.arange(6) // 3,
        versions=torch.zeros(2, dtype=torch.long),
    )
    theta = rank.score(rank.model, batch)  # (B, R) log pi_theta before the step
    delta = torch.zeros_like(theta)
    if shift == "minus_half":
        delta[mask] = -0.5
    else:
        signs = torch.ones(int(mask.sum()))
        signs[1::2] = -1.0
        if len(signs) % 2:
            signs[-1] = 0.0  # an odd count: the last token unmoved, the signed sum still 0
        delta[mask] = signs
    batch.behav_logp = theta + delta  # pi_behav = pi_old: no rollout correction in the way
    return batch, theta + delta


# Where the loss's pi_old comes from: scored ahead (taken as it is), loglinear (at alpha 0: pi_behav), bypass (pi_behav)
PI_OLD_PATHS = {
    "scored": {},
    "loglinear": {"algorithm.prox_logp_method": "loglinear"},
    "bypass": {"algorithm.rollout_correction.bypass_mode": True},
}


@pytest.mark.parametrize("path", list(PI_OLD_PATHS))
@pytest.mark.parametrize("shift", ["minus_half", "alternating"], ids=["signed ppo_kl -0.5", "signed ppo_kl 0"])
def test_the_guard_catches_a_moved_policy_whose_signed_ppo_kl_is_not_positive(small_cfg, shift, path):
    """pi_old's log-probs put pi_theta 0.5 above them on every valid token, or alternately 1 above and below:
    actor/ppo_kl, the signed mean, is -0.5 or 0, under the bound 0.1, but the policy is far from pi_old. k3 (e^0.5 -
    1.5 = 0.149, or the mean of e - 2 and 1/e) is past it: no step, on each path pi_old reaches the loss by."""
    cfg = small_cfg(**{"actor.max_ppo_kl": 0.1, "actor.micro_batch_size": 4, **PI_OLD_PATHS[path]})
    rank = ActorRank(actor_settings(cfg), choose_pi_old(cfg), 0, 1, 12)
    rank.init_model(*rank.master_address())
    batch, old = moved_batch(rank, shift)
    delta, mask = old - rank.score(rank.model, batch), batch.response_mask
    before = {k: v.clone() for k, v in rank.model.state_dict().items()}
    advantages = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    metrics = rank.update_actor(1, batch, advantages, 0, old if path == "scored" else None)
    expected_k3 = float((torch.exp(-delta) + delta - 1)[mask].mean())
    assert metrics["actor/ppo_kl"] == pytest.approx(float(delta[mask].mean()), abs=1e-6)
    assert metrics["actor/ppo_kl"] <= 1e-6  # the signed mean: under the bound, 0 or below
    assert metrics["actor/ppo_kl_k3"] == pytest.approx(expected_k3, rel=1e-5) and expected_k3 > 0.1
    assert metrics["actor/skipped_updates"] == 1.0
    assert all(torch.equal(v, before[k]) for k, v in rank.model.state_dict().items())
    rank.close()
