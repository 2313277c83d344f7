"""Score-ahead (snapshot.score_ahead) without Ray: the later mini-batches of a cycle scored at trigger 0 give the
old log-probs and weights a run that reads slot 0 gives, bitwise; verify_old_log_prob checks them; a mid-cycle
checkpoint keeps the held mini-batches and a resumed run continues exactly."""

import pytest
import torch

import dppo.trainer.base as base
from dppo.checkpoint import store as ckpt
from dppo.checkpoint.layout import TRAINER_FILE
from dppo.trainer.ppo import PPOTrainer
from dppo.trainer.report import read_metrics
from dppo.trainer.rollout import RolloutFailedError, make_rollout
from dppo.batch import Group
from dppo.workers.rollout.buffer_server import ReplayBufferActor
from dppo.workers.rollout.replay_buffer import Finished
from partial_rollout import (
    PartialRollout,
    record_slot_use,
)  # tests/partial_rollout.py (tests/conftest.py puts tests/ on sys.path)

PS = 3
REWARD_EXTRAS = base._reward_extras  # called by the loop once per trained trigger, with its groups


def ahead_cfg(small_cfg, score_ahead: bool, **extra):
    return small_cfg(**{
        "trainer.parameter_sync_step": PS,
        "trainer.train_batch_size": 2 * PS,
        "trainer.total_steps": 2,
        "actor.lr": 0.05,  # large steps: the live weights leave pi_old visibly within the cycle
        "snapshot.score_ahead": score_ahead,
        **extra,
    })  # fmt: skip


def recording_run(cfg, monkeypatch, rollout=None):
    """fit() a trainer for cfg; (trainer, grant indices of each trigger's groups, each trigger's old log-probs).
    rollout(trainer): the rollout source to run with (default: the one fit() makes)."""
    trainer = PPOTrainer(cfg)
    trainer.rollout = rollout(trainer) if rollout else None
    rank = trainer.actor_group.local_rank
    taken, prox = [], []
    record_used = rank.pi_old.record_used

    def record_groups(groups):
        taken.append([g.index for g in groups])
        return REWARD_EXTRAS(groups)

    def record_prox(batch, prox_logp):  # what the loss used: the training forward's, slot 0's or scored ahead
        prox.append(prox_logp.clone())
        record_used(batch, prox_logp)

    monkeypatch.setattr(base, "_reward_extras", record_groups)
    rank.pi_old.record_used = record_prox
    trainer.fit()
    return trainer, taken, prox


def weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.actor_group.local_rank.model.state_dict().items()}


@pytest.mark.parametrize("precision", [None, "bfloat16"])  # actor.mixed_precision: bf16 compute over fp32 weights
def test_sync_score_ahead_on_and_off_take_the_same_groups_and_give_bitwise_the_same_old_log_probs_and_weights(
    small_cfg, monkeypatch, precision
):
    out = small_cfg().trainer.output_dir
    mp = {"actor.mixed_precision": precision}
    on, on_taken, on_prox = recording_run(
        ahead_cfg(small_cfg, True, **{"trainer.verify_old_log_prob": True, "trainer.output_dir": f"{out}-on", **mp}),
        monkeypatch,
    )
    off, off_taken, off_prox = recording_run(ahead_cfg(small_cfg, False, **mp), monkeypatch)
    assert off_taken == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]  # grant order, one trigger after another
    assert on_taken == off_taken
    assert len(on_prox) == len(off_prox) == 2 * PS
    for k, (a, b) in enumerate(zip(on_prox, off_prox)):
        assert torch.equal(a, b), f"trigger {k % PS} of step {k // PS}"
    for name, value in weights(off).items():
        assert torch.equal(weights(on)[name], value), name
    on_records = read_metrics(on.metrics.path)
    assert [r["snapshot/scored_ahead_frac"] for r in on_records] == [1.0, 1.0]
    assert [r["debug/old_log_prob_max_abs_diff"] for r in on_records] == [0.0, 0.0]
    # every later mini-batch was scored ahead: no snapshot was taken (slot 0 is never filled); off takes one a cycle
    on_source, off_source = on.actor_group.local_rank.pi_old.source, off.actor_group.local_rank.pi_old.source
    assert on_source.moved_bytes == 0 and 0 not in on_source.pool
    assert off_source.moved_bytes == 2 * off_source.pool.nbytes
    assert "snapshot/scored_ahead_frac" not in read_metrics(off.metrics.path)[0]


def test_a_partial_score_ahead_reads_slot_0_where_it_did_not_score_and_matches_a_run_without_it_bitwise(
    small_cfg, monkeypatch
):
    """parameter_sync_step=4: at trigger 0 one later mini-batch has arrived in step 1 and two in step 2 (PartialRollout,
    by count): trigger 0 still takes a snapshot, the triggers not scored ahead read slot 0, and every old log-prob,
    taken group and final weight equals that of a run that reads slot 0 at every trigger."""
    out = small_cfg().trainer.output_dir
    four = {"trainer.parameter_sync_step": 4, "trainer.train_batch_size": 8}
    made = {}

    def staggered(trainer):  # groups ready beyond trigger 0's own: 2 (one mini-batch) in step 1, 4 in step 2
        made["events"] = record_slot_use(trainer.actor_group.local_rank.pi_old.source)
        made["rollout"] = PartialRollout(make_rollout(trainer.cfg, trainer.source, trainer.model_config), [2, 4])
        return made["rollout"]

    on, on_taken, on_prox = recording_run(
        ahead_cfg(small_cfg, True, **{**four, "trainer.verify_old_log_prob": True, "trainer.output_dir": f"{out}-on"}),
        monkeypatch,
        staggered,
    )
    off, off_taken, off_prox = recording_run(ahead_cfg(small_cfg, False, **four), monkeypatch)
    assert made["rollout"].ready_calls == [True, False, True, True, False]  # step 1: 1 of 3 ready; step 2: 2 of 3
    records = read_metrics(on.metrics.path)
    assert [r["snapshot/scored_ahead_frac"] for r in records] == [1 / 3, 2 / 3]
    assert [r["debug/old_log_prob_max_abs_diff"] for r in records] == [0.0, 0.0]
    # a snapshot in each cycle (neither was scored wholly ahead); the triggers not scored ahead, and only they,
    # read slot 0: triggers 2 and 3 of step 1, trigger 3 of step 2
    assert made["events"] == ["save", 2, 3, "save", 3]
    assert on_taken == off_taken == [[2 * i, 2 * i + 1] for i in range(8)]
    for k, (a, b) in enumerate(zip(on_prox, off_prox, strict=True)):
        assert torch.equal(a, b), f"trigger {k % 4} of step {k // 4}"
    for name, value in weights(off).items():
        assert torch.equal(weights(on)[name], value), name


def test_verify_old_log_prob_checks_scored_ahead_old_log_probs(small_cfg, monkeypatch):
    """Old log-probs that are off by 0.25 when scored ahead are reported, and only in the cycle where they were."""
    trainer, calls = PPOTrainer(ahead_cfg(small_cfg, True, **{"trainer.verify_old_log_prob": True})), []
    rank = trainer.actor_group.local_rank
    score_ahead = rank.score_ahead

    def off_in_step_2(batches, whole_cycle):
        calls.append(whole_cycle)
        logps = score_ahead(batches, whole_cycle)
        return [logp + 0.25 for logp in logps] if len(calls) == 2 else logps

    monkeypatch.setattr(rank, "score_ahead", off_in_step_2)
    result = trainer.fit()
    assert calls == [True, True]
    diffs = [r["debug/old_log_prob_max_abs_diff"] for r in result.records]
    assert diffs[0] == 0.0 and diffs[1] == pytest.approx(0.25, abs=1e-6)


def without_timing(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("timing_s/")} for r in records]


def test_a_mid_cycle_checkpoint_keeps_the_mini_batches_held_ahead_and_the_resumed_run_is_bitwise_the_same(
    small_cfg, monkeypatch
):
    """A failure while step 2's trigger 1 trains (its mini-batch and trigger 2's held since trigger 0): the checkpoint
    holds both with their old log-probs and no pi_old weights (none were taken); the resumed run trains them
    without fetching them again and ends with the weights and metrics of a run that never failed."""
    common = {"trainer.checkpoint_every": 10, "trainer.output_dir": None}
    out = small_cfg().trainer.output_dir
    clean = PPOTrainer(ahead_cfg(small_cfg, True, **{**common, "trainer.output_dir": f"{out}-clean"}))
    clean.fit()
    expected_records, expected_weights = read_metrics(f"{out}-clean/metrics.jsonl"), weights(clean)

    train_trigger = PPOTrainer.train_trigger

    def failing(self, batch, prox_logp=None):
        if (self.global_step, self.local_trigger_step) == (1, 1):
            assert prox_logp is not None  # held since trigger 0
            raise RolloutFailedError("the replay buffer died")
        return train_trigger(self, batch, prox_logp)

    monkeypatch.setattr(PPOTrainer, "train_trigger", failing)
    with pytest.raises(RolloutFailedError, match=r"the trainer's state at step 1, trigger 1 is checkpointed"):
        PPOTrainer(ahead_cfg(small_cfg, True, **{**common, "trainer.output_dir": out})).fit()
    monkeypatch.setattr(PPOTrainer, "train_trigger", train_trigger)
    path, state = ckpt.CheckpointDir(f"{out}/checkpoints").newest(lambda p, m: ckpt.load_torch(p / TRAINER_FILE))
    assert path.name == "step_00000001_trigger_1" and state["anchor"] is False  # weights_only-loaded
    held = state["cycle"]["ahead"]
    assert [[g["index"] for g in h["groups"]] for h in held] == [[8, 9], [10, 11]]  # triggers 1 and 2 of step 2
    assert all(h["prox_logp"].shape == (8, h["groups"][0]["responses"].shape[1]) for h in held)
    assert state["rollout"]["next_grant"] == 12

    fetched = []
    resumed = PPOTrainer(ahead_cfg(small_cfg, True, **{**common, "trainer.output_dir": out, "trainer.resume": True}))
    assert (resumed.global_step, resumed.progress.trigger, len(resumed.progress.ahead)) == (1, 1, 2)
    assert (resumed.rollout_start.consumed, resumed.rollout_start.next_grant) == (12, 12)
    start = resumed.state.rollout_start
    took = start.took
    start.took = lambda version, groups, *rest: (
        fetched.append([g.index for g in groups]) or took(version, groups, *rest)
    )
    resumed.fit()
    assert fetched == []  # the held mini-batches finished the cycle, and nothing was taken again
    for name, tensor in weights(resumed).items():
        assert torch.equal(tensor, expected_weights[name]), name
    got, want = without_timing(read_metrics(f"{out}/metrics.jsonl")), without_timing(expected_records)
    assert got == want


def test_a_mid_cycle_checkpoint_keeps_the_cycles_verification_and_the_resumed_cycle_reports_all_of_it(
    small_cfg, monkeypatch
):
    """trainer.verify_old_log_prob over step 2, whose trigger 1 uses old log-probs off by 0.25 (scored ahead, off on
    purpose) and which fails at trigger 2: the checkpoint's pi_old record keeps the verifier's 0.25 (the ranks'
    pi_old_state), and the resumed run checks trigger 2 against the weights the cycle was published as (the ranks
    kept none: all of it was scored ahead; load_published_pi_old) and reports the whole cycle's 0.25."""
    out = small_cfg().trainer.output_dir
    common = {"trainer.checkpoint_every": 10, "trainer.verify_old_log_prob": True, "trainer.output_dir": out}
    trainer = PPOTrainer(ahead_cfg(small_cfg, True, **common))
    rank = trainer.actor_group.local_rank
    score_ahead = rank.score_ahead

    def off_at_trigger_1_of_step_2(batches, whole_cycle):
        logps = score_ahead(batches, whole_cycle)
        return [logps[0] + 0.25, *logps[1:]] if trainer.global_step == 1 else logps

    train_trigger = PPOTrainer.train_trigger

    def failing(self, batch, prox_logp=None):
        if (self.global_step, self.local_trigger_step) == (1, 2):
            raise RolloutFailedError("the replay buffer died")
        return train_trigger(self, batch, prox_logp)

    monkeypatch.setattr(rank, "score_ahead", off_at_trigger_1_of_step_2)
    monkeypatch.setattr(PPOTrainer, "train_trigger", failing)
    with pytest.raises(RolloutFailedError, match=r"the trainer's state at step 1, trigger 2 is checkpointed"):
        trainer.fit()
    monkeypatch.setattr(PPOTrainer, "train_trigger", train_trigger)
    path, state = ckpt.CheckpointDir(f"{out}/checkpoints").newest(lambda p, m: ckpt.load_torch(p / TRAINER_FILE))
    assert path.name == "step_00000001_trigger_2" and state["pi_old"]["weights"] == "file"
    assert state["pi_old"]["strategy"]["max_abs_diff"] == pytest.approx(0.25, abs=1e-6)

    PPOTrainer(ahead_cfg(small_cfg, True, **{**common, "trainer.resume": True})).fit()
    diffs = [r["debug/old_log_prob_max_abs_diff"] for r in read_metrics(f"{out}/metrics.jsonl")]
    assert diffs[0] == 0.0 and diffs[1] == pytest.approx(0.25, abs=1e-6)
    assert "debug/old_log_prob_unverified" not in read_metrics(f"{out}/metrics.jsonl")[1]  # trigger 2 was checked


def group(version: int) -> Group:
    return Group(
        torch.zeros(3, dtype=torch.long),
        torch.zeros(2, 4, dtype=torch.long),
        torch.ones(2, 4, dtype=torch.bool),
        torch.zeros(2, 4),
        torch.zeros(2),
        version,
    )


def test_the_buffer_actor_takes_ready_groups_in_grant_order_without_waiting():
    """take_ready returns None, popping nothing, while an earlier grant is still being generated; then the same
    groups take would return."""

    buffer = ReplayBufferActor(1, "wait", 4)
    buffer.publish(["w0"], 0)
    first, second = buffer.acquire(-1, 2, "a"), buffer.acquire(-1, 2, "b")
    buffer.put(Finished([group(0), group(0)], second.first), "b")
    assert buffer.take_ready(2, 0) is None  # grants 0 and 1 are still in flight
    assert buffer.core.stats()["replay/size"] == 2.0
    buffer.put(Finished([group(0), group(0)], first.first), "a")
    taken, dropped = buffer.take_ready(2, 0)
    assert [g.index for g in taken] == [0, 1] and dropped == 0
    taken, _ = buffer.take_ready(2, 0)
    assert [g.index for g in taken] == [2, 3]
    assert buffer.take_ready(1, 0) is None
