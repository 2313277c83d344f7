"""actor.optim's lr schedule in a whole (in-process) run: each optimizer step's lr is actor.lr x factor(its index),
logged as actor/lr, its warmup counted in verl's unit (global steps); a run checkpointed mid-schedule (mid-cycle,
after a rollout failure) and resumed ends with the weights, lr and metrics of the run that never stopped. verl's
formulas: tests/oracle/test_oracle_lr_schedule.py."""

from __future__ import annotations

import pytest
import torch

from dppo.config import ConfigError
from dppo.trainer.ppo import PPOTrainer
from dppo.trainer.report import read_metrics
from dppo.trainer.rollout import InProcessRollout, RolloutFailedError
from dppo.workers.actor.lr_schedule import lr_factor

PS, STEPS, LR = 2, 4, 0.01
SCHEDULE = {
    "trainer.parameter_sync_step": PS,
    "trainer.total_steps": STEPS,
    "actor.lr": LR,
    "actor.optim.lr_warmup_steps": 2,  # global steps: optimizer steps 0-3
    "actor.optim.lr_scheduler_type": "cosine",
    "actor.optim.min_lr_ratio": 0.1,
    "snapshot.score_ahead": False,
}


def cycle_mean(values: list[float]) -> float:
    total = 0.0
    for v in values:  # as CycleMetrics adds a cycle's triggers
        total += v
    return total / len(values)


def test_each_optimizer_step_takes_its_lr_from_the_schedule_and_logs_it(small_cfg):
    cfg = small_cfg(**SCHEDULE)
    trainer = PPOTrainer(cfg)
    trainer.fit()
    factor = lr_factor(cfg.actor.optim, STEPS, PS)
    lrs = [LR * factor(k) for k in range(STEPS * PS)]
    # verl's warmup from 0 over 2 global steps (4 optimizer steps, not 2), then the cosine from the top
    assert lrs[:5] == pytest.approx([0.0, LR / 4, LR / 2, 3 * LR / 4, LR], rel=1e-15)
    assert [r["actor/lr"] for r in trainer.metrics.records] == [
        cycle_mean(lrs[k : k + PS]) for k in range(0, STEPS * PS, PS)
    ]
    rank = trainer.actor_group.local_rank
    assert rank.lr_scheduler.last_epoch == STEPS * PS
    assert rank.optimizer.param_groups[0]["lr"] == LR * factor(STEPS * PS)  # the next step's: the run's floor


def weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.actor_group.local_rank.model.state_dict().items()}


def test_a_run_resumed_mid_schedule_follows_the_same_curve_bitwise(small_cfg, monkeypatch):
    """The rollout fails at step 3's trigger 1 (optimizer step 5 of 8, mid-cycle, past the warmup): the checkpoint
    holds the schedule's 5 steps on the rank, and the resumed run ends with the weights, optimizer lr and metrics of
    the run that never failed."""
    common = {**SCHEDULE, "trainer.checkpoint_every": 10, "trainer.output_dir": None}
    out = small_cfg().trainer.output_dir
    clean = PPOTrainer(small_cfg(**{**common, "trainer.output_dir": f"{out}-clean"}))
    clean.fit()
    expected, expected_weights = read_metrics(f"{out}-clean/metrics.jsonl"), weights(clean)
    expected_lr = clean.actor_group.local_rank.optimizer.param_groups[0]["lr"]

    fetch, calls = InProcessRollout.fetch, []

    def failing_fetch(self, num_groups, trainer_version):
        calls.append(trainer_version)
        if len(calls) == 2 * PS + 2:  # step 3, trigger 1
            raise RolloutFailedError("the replay buffer died")
        return fetch(self, num_groups, trainer_version)

    monkeypatch.setattr(InProcessRollout, "fetch", failing_fetch)
    failed = PPOTrainer(small_cfg(**{**common, "trainer.output_dir": out}))
    with pytest.raises(RolloutFailedError, match=r"step 2, trigger 1 is checkpointed"):
        failed.fit()
    assert failed.actor_group.local_rank.lr_scheduler.last_epoch == 2 * PS + 1
    monkeypatch.setattr(InProcessRollout, "fetch", fetch)

    resumed = PPOTrainer(small_cfg(**{**common, "trainer.output_dir": out, "trainer.resume": True}))
    rank = resumed.actor_group.local_rank
    assert resumed.resumed_from.name == "step_00000002_trigger_1"
    assert rank.lr_scheduler.last_epoch == 2 * PS + 1
    assert rank.optimizer.param_groups[0]["lr"] == LR * lr_factor(resumed.cfg.actor.optim, STEPS, PS)(2 * PS + 1)
    resumed.fit()
    for name, tensor in weights(resumed).items():
        assert torch.equal(tensor, expected_weights[name]), name
    assert rank.optimizer.param_groups[0]["lr"] == expected_lr
    got, want = [
        [{k: v for k, v in r.items() if not k.startswith("timing_s/")} for r in rs]
        for rs in (read_metrics(f"{out}/metrics.jsonl"), expected)
    ]
    assert [{k: (v, b.get(k)) for k, v in a.items() if b.get(k) != v} for a, b in zip(got, want)] == [{}] * len(want)


def test_verls_names_are_taken_and_bad_values_refused(small_cfg):
    cfg = small_cfg(**{"actor.optim.lr": 5e-4, "actor.optim.warmup_style": "cosine"})
    assert cfg.actor.lr == 5e-4 and cfg.actor.optim.lr_scheduler_type == "cosine"
    with pytest.raises(ConfigError, match=r"^actor.optim.lr=0.003: expected the same value as actor.lr=0.002"):
        small_cfg(**{"actor.lr": 0.002, "actor.optim.lr": 0.003})
    with pytest.raises(
        ConfigError, match=r"^actor.optim.lr_scheduler_type='linear': expected one of 'constant', 'cosine'$"
    ):
        small_cfg(**{"actor.optim.lr_scheduler_type": "linear"})
    with pytest.raises(ConfigError, match=r"^actor.optim.lr_warmup_steps=3: longer than the run's 2 global steps"):
        small_cfg(**{"actor.optim.lr_warmup_steps": 3})  # 3 global steps of a run of 2 (of 4 optimizer steps)
    with pytest.raises(ConfigError, match=r"^actor.optim.min_lr_ratio=1.5: expected a fraction in \[0, 1\]$"):
        small_cfg(**{"actor.optim.min_lr_ratio": 1.5})
