"""algorithm.filter_groups (DAPO's dynamic sampling): which groups a trigger keeps, how it draws more, what it tells
the replay buffer, and the whole loop in process: score-ahead, a mid-cycle checkpoint holding a half-drawn mini-batch,
and a run that learns. The rule itself is checked against verl's own code in tests/oracle/test_oracle_filter_groups.py."""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import dppo.trainer.base as base
import dppo.trainer.filter_groups as filter_groups
from dppo.config import ConfigError
from dppo.data import DataError
from dppo.batch import Group
from dppo.checkpoint import store as ckpt
from dppo.checkpoint.layout import TRAINER_FILE
from dppo.cli import main
from dppo.tasks import TASKS, Task, digit_task
from dppo.trainer.filter_groups import FilterMetricError, GroupFilter, keeps
from dppo.trainer.ppo import PPOTrainer
from dppo.trainer.report import read_metrics
from dppo.trainer.rollout import RolloutFailedError, make_rollout
from dppo.workers.rollout.replay_buffer import Finished, ReplayBufferCore
from partial_rollout import PartialRollout  # tests/partial_rollout.py (tests/conftest.py puts tests/ on sys.path)


def group(scores, index: int = -1, **extra) -> Group:
    n = len(scores)
    return Group(
        torch.zeros(3, dtype=torch.long),
        torch.zeros(n, 2, dtype=torch.long),
        torch.ones(n, 2, dtype=torch.bool),
        torch.zeros(n, 2),
        torch.tensor(scores, dtype=torch.float32),
        0,
        index,
        {k: torch.tensor(v, dtype=torch.float32) for k, v in extra.items()},
    )


# ---- the rule ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("scores", "kept"), [
    ([1.0, 1.0, 1.0, 1.0], False),      # solved: every response right
    ([0.0, 0.0, 0.0, 0.0], False),      # every response wrong
    ([0.4, 0.4, 0.4, 0.4], False),      # partial credit, the same for all
    ([1.0, 0.0, 1.0, 1.0], True),
    ([0.5, 0.5, 0.5, 0.50000006], True),  # one fp32 step apart: not the same
    ([0.3], True),                      # one response: verl keeps it (len > 1 is part of its test)
])  # fmt: skip
def test_a_group_is_dropped_exactly_when_all_its_rewards_are_equal(scores, kept):
    for metric in ("reward", "score", "seq_reward"):
        assert keeps(group(scores), metric) is kept


def test_an_extra_metric_is_read_from_the_reward_functions_extra_outputs():
    varied_reward_same_acc = group([0.2, 0.9, 0.5, 0.5], acc=[1.0, 1.0, 1.0, 1.0])
    assert keeps(varied_reward_same_acc, "reward") and not keeps(varied_reward_same_acc, "acc")
    assert keeps(group([1.0, 1.0], acc=[0.0, 1.0]), "acc")
    with pytest.raises(
        FilterMetricError,
        match=r"returned no 'acc' for some response of group 7 \(its extra outputs: "
        r"none\)",
    ):
        keeps(group([1.0, 0.0], 7), "acc")
    with pytest.raises(
        FilterMetricError, match=r"no 'acc' .*\(its extra outputs: acc\)"
    ):  # NaN: that response's dict lacked it
        keeps(group([1.0, 0.0], acc=[1.0, float("nan")]), "acc")


# ---- drawing a mini-batch ----------------------------------------------------------------------------------------


class ScriptedRollout:
    """Groups 0, 1, ... in grant order, of the given rewards; fetch takes the next ones; fetch_ready takes them only
    while `ready` groups are left (None: all are); every call and discard is recorded."""

    def __init__(self, rewards, ready: int | None = None) -> None:
        self.groups = [group(r, i) for i, r in enumerate(rewards)]
        self.next, self.ready = 0, ready
        self.fetches, self.discards = [], []

    def fetch(self, num_groups, version):
        if self.next + num_groups > len(self.groups):  # a draw that does not stop: fail, never spin on empty takes
            raise AssertionError(f"a take of {num_groups} groups past the script's {len(self.groups)}")
        self.fetches.append(num_groups)
        taken = self.groups[self.next : self.next + num_groups]
        self.next += num_groups
        return taken, 0

    def fetch_ready(self, num_groups, version):
        if self.ready is not None:
            if self.ready < num_groups:
                self.fetches.append(None)
                return None
            self.ready -= num_groups
        return self.fetch(num_groups, version)

    def discard(self, count):
        self.discards.append(count)


SAME, VARIED = [1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 1.0, 1.0]


def make_filter(enable=True, limit=0, size=2) -> GroupFilter:
    return GroupFilter(SimpleNamespace(enable=enable, metric="reward", max_num_gen_batches=limit), size)


def indices(groups) -> list[int]:
    return [g.index for g in groups]


def test_a_draw_takes_only_the_missing_groups_until_the_mini_batch_is_full():
    rollout = ScriptedRollout([SAME, VARIED, SAME, [0.0] * 4, VARIED, VARIED])
    draw = make_filter().fetch(rollout, 0)
    assert rollout.fetches == [2, 1, 1, 1]  # 2, then each time the one still missing
    assert indices(draw.taken) == [0, 1, 2, 3, 4] and draw.kept == [False, True, False, False, True]
    assert indices(draw.groups(2)) == [1, 4]
    assert rollout.discards == [1, 1, 1] and draw.discarded == 3  # told at once, one fetch at a time
    assert make_filter().metrics(draw) == {
        "filter_groups/draws": 2.5,
        "filter_groups/kept_frac": 2 / 5,
        "filter_groups/at_limit": 0.0,
    }


def test_without_the_filter_a_draw_is_one_fetch_of_the_mini_batch():
    rollout = ScriptedRollout([SAME, SAME, VARIED])
    draw = make_filter(enable=False).fetch(rollout, 0)
    assert rollout.fetches == [2] and indices(draw.groups(2)) == [0, 1] and rollout.discards == []
    assert make_filter(enable=False).metrics(draw) == {}


def test_at_the_limit_the_trigger_trains_on_what_it_kept():
    rollout = ScriptedRollout([SAME, VARIED, SAME, SAME, VARIED])
    draw = make_filter(limit=2).fetch(rollout, 0)  # at most 2 x 2 groups
    assert rollout.fetches == [2, 1, 1] and indices(draw.taken) == [0, 1, 2, 3]
    assert indices(draw.groups(2)) == [1]  # one group: a smaller mini-batch, never a padded one
    assert rollout.discards == [1, 1, 1]


def test_without_a_limit_a_draw_stops_at_the_default_limit_and_trains_on_what_it_kept():
    """max_num_gen_batches=0: verl would draw until G groups are kept; dppo stops at DEFAULT_MAX_BATCHES x G taken."""
    assert filter_groups.DEFAULT_MAX_BATCHES == 10
    rollout = ScriptedRollout([SAME] * 5 + [VARIED] + [SAME] * 40)
    draw = make_filter().fetch(rollout, 0)
    assert rollout.fetches == [2, 2, 2] + [1] * 14 and rollout.next == 20  # 10 x 2 groups taken, not one more
    assert indices(draw.groups(2)) == [5]  # one group: a smaller mini-batch
    assert sum(rollout.discards) == draw.discarded == 19
    assert make_filter().metrics(draw) == {
        "filter_groups/draws": 10.0,
        "filter_groups/kept_frac": 1 / 20,
        "filter_groups/at_limit": 1.0,
    }


@pytest.mark.parametrize("ready", [False, True])
def test_without_a_limit_a_draw_that_keeps_nothing_stops_with_an_error_at_the_default_limit(ready):
    rollout = ScriptedRollout([SAME] * 40)
    fetch = make_filter().fetch_ready if ready else make_filter().fetch
    with pytest.raises(
        filter_groups.NothingKeptError,
        match=r"^algorithm.filter_groups kept none of the 20 groups a trigger drew \(10 mini-batches' worth, its "
        r"limit where max_num_gen_batches=0 sets none\): reward was the same for every response of each ",
    ):
        fetch(rollout, 0)
    assert rollout.next == 20
    assert isinstance(filter_groups.NothingKeptError("x"), DataError)  # exit code 6
    draw = make_filter(limit=10).fetch(ScriptedRollout([SAME] * 40), 0)  # a limit set: the last mini-batch
    assert indices(draw.groups(2)) == [18, 19]


def test_at_the_limit_with_nothing_kept_the_trigger_trains_on_the_last_mini_batch_taken():
    rollout = ScriptedRollout([SAME, SAME, SAME, [0.0] * 4, VARIED])
    draw = make_filter(limit=2).fetch(rollout, 0)
    assert rollout.fetches == [2, 2] and indices(draw.groups(2)) == [2, 3]
    assert rollout.discards == [2]  # the first two only: the last two are trained on
    assert make_filter(limit=2).metrics(draw) == {
        "filter_groups/draws": 2.0,
        "filter_groups/kept_frac": 0.0,
        "filter_groups/at_limit": 1.0,
    }


def test_a_draw_from_ready_groups_stops_where_they_end_and_its_trigger_finishes_it_as_one_draw_would():
    rewards = [SAME, VARIED, SAME, SAME, VARIED, VARIED]
    whole = make_filter().fetch(ScriptedRollout(rewards), 0)
    rollout = ScriptedRollout(rewards, ready=3)
    partial = make_filter().fetch_ready(rollout, 0)
    assert rollout.fetches == [2, 1, None] and indices(partial.taken) == [0, 1, 2] and not make_filter().done(partial)
    done = make_filter().fetch(rollout, 0, partial)
    assert indices(partial.taken) == [0, 1, 2]  # the pending draw itself is left as committed
    assert rollout.fetches == [2, 1, None, 1, 1]
    assert indices(done.taken) == indices(whole.taken) == [0, 1, 2, 3, 4]
    assert indices(done.groups(2)) == indices(whole.groups(2)) == [1, 4]
    assert done.discarded == whole.discarded == sum(rollout.discards) == 3
    nothing = make_filter().fetch_ready(ScriptedRollout(rewards, ready=1), 0)
    assert nothing.taken == []  # its first take was not there: nothing taken


def test_discarded_groups_free_the_wait_budget_so_a_trainer_drawing_more_never_waits_forever():
    """Under wait the buffer grants groups while those the trainer will train on stay within (v + eta + 1) B; a
    trainer that took B groups and dropped them all must get B more at the same version."""
    buffer = ReplayBufferCore(0, "wait", 2)
    buffer.publish("w0", 0)
    ticket = buffer.acquire(-1, 4)
    assert ticket.num_groups == 2 and buffer.grantable() == 0  # (0 + 0 + 1) x 2 granted
    buffer.put(Finished([group(SAME), group(SAME)], ticket.first))
    taken, _ = buffer.take(2, 0)
    assert buffer.grantable() == 0 and buffer.acquire(0, 2) is None  # without the discard: no grant, ever
    buffer.discard(2)
    assert buffer.grantable() == 2 and buffer.acquire(0, 2).first == 2
    with pytest.raises(ValueError, match="discard of -1 groups"):
        buffer.discard(-1)


# ---- config -------------------------------------------------------------------------------------------------------


def test_a_task_run_refuses_a_metric_its_reward_does_not_have(small_cfg):
    with pytest.raises(
        ConfigError,
        match=r"^algorithm.filter_groups.metric='acc': the run trains on task.name='copy', "
        r"whose reward has no extra outputs \(only a custom_reward_function does\); "
        r"use reward or score or seq_reward$",
    ):
        small_cfg(**{"algorithm.filter_groups.enable": True, "algorithm.filter_groups.metric": "acc"})
    assert small_cfg(**{"algorithm.filter_groups.metric": "acc"}).algorithm.filter_groups.metric == "acc"  # off: unread


# ---- in process ---------------------------------------------------------------------------------------------------

PS = 3
REWARD_EXTRAS = base._reward_extras  # called by the loop once per trained trigger, with its groups


def filter_cfg(small_cfg, **extra):
    return small_cfg(**{
        "trainer.parameter_sync_step": PS,
        "trainer.train_batch_size": 2 * PS,
        "trainer.total_steps": 2,
        "actor.lr": 0.05,
        "algorithm.filter_groups.enable": True,
        **extra,
    })  # fmt: skip


def drop_every_third(group: Group, metric: str) -> bool:
    """A rule that drops groups 0, 3, 6, ... whatever their rewards: the loop's bookkeeping, independent of the data."""
    return group.index % 3 != 0


def recording_run(cfg, monkeypatch, rollout=None, rule=drop_every_third):
    """fit() a trainer for cfg under rule (keeps' stand-in); (trainer, grant indices of each trained trigger's
    groups). rollout(trainer): the rollout source to use instead of the one the trainer makes."""
    monkeypatch.setattr(filter_groups, "keeps", rule)
    trainer = PPOTrainer(cfg)
    if rollout:
        trainer.rollout = rollout(trainer)
    trained = []
    monkeypatch.setattr(base, "_reward_extras", lambda groups: trained.append(indices(groups)) or REWARD_EXTRAS(groups))
    trainer.fit()
    return trainer, trained


def weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.actor_group.local_rank.model.state_dict().items()}


TRAINED = [[1, 2], [4, 5], [7, 8], [10, 11], [13, 14], [16, 17]]  # groups 0, 3, ... dropped, the next ones taken


def test_score_ahead_draws_the_same_groups_as_the_triggers_would_and_gives_bitwise_the_same_weights(
    small_cfg, monkeypatch
):
    out = small_cfg().trainer.output_dir
    on, on_trained = recording_run(filter_cfg(small_cfg, **{"trainer.output_dir": f"{out}-on"}), monkeypatch)
    off, off_trained = recording_run(filter_cfg(small_cfg, **{"snapshot.score_ahead": False}), monkeypatch)
    assert on_trained == off_trained == TRAINED
    for name, value in weights(off).items():
        assert torch.equal(weights(on)[name], value), name
    for trainer in (on, off):
        records = read_metrics(trainer.metrics.path)
        assert [r["filter_groups/kept_frac"] for r in records] == [2 / 3, 2 / 3]
        assert [r["filter_groups/draws"] for r in records] == [1.5, 1.5]
        assert [r["filter_groups/at_limit"] for r in records] == [0.0, 0.0]
        assert trainer.rollout_start.next_grant == 18  # every group taken, the dropped ones too
    assert [r["snapshot/scored_ahead_frac"] for r in read_metrics(on.metrics.path)] == [1.0, 1.0]


def test_the_sampled_reward_counts_every_group_taken_and_the_rollout_those_trained_on(small_cfg, monkeypatch):
    draws = []
    fetch, fetch_ready = GroupFilter.fetch, GroupFilter.fetch_ready
    monkeypatch.setattr(GroupFilter, "fetch", lambda *a, **k: draws.append(fetch(*a, **k)) or draws[-1])
    monkeypatch.setattr(GroupFilter, "fetch_ready", lambda *a, **k: draws.append(fetch_ready(*a, **k)) or draws[-1])
    trainer, trained = recording_run(filter_cfg(small_cfg, **{"trainer.total_steps": 1}), monkeypatch)
    assert trained == TRAINED[:PS] and [indices(d.taken) for d in draws] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    scores = torch.cat([d.taken_scores() for d in draws])  # 9 groups of 4, in trigger order, as the loop joins them
    assert scores.shape == (36,)
    assert trainer.metrics.records[0]["critic/score/mean"] == float(scores.mean())
    assert trainer.rollout_start.consumed == 6 and trainer.rollout_start.next_grant == 9  # 3 taken and discarded


def test_a_mid_cycle_checkpoint_keeps_a_half_drawn_mini_batch_and_the_resumed_run_is_bitwise_the_same(
    small_cfg, monkeypatch
):
    """At step 2's trigger 0 only 5 groups beyond its own have arrived (PartialRollout): trigger 1's draw (12 dropped,
    13, 14) is held, trigger 2's takes 15 (dropped) and 16 and stops; the rollout fails while trigger 2 trains, after
    it drew group 17. The checkpoint holds the half-drawn mini-batch; the resumed run draws the rest and ends with the
    weights and metrics of a run that never failed."""
    common = {"trainer.checkpoint_every": 10, "trainer.output_dir": None}
    out = small_cfg().trainer.output_dir
    clean, clean_trained = recording_run(
        filter_cfg(small_cfg, **{**common, "trainer.output_dir": f"{out}-clean"}), monkeypatch
    )
    expected_records, expected_weights = read_metrics(f"{out}-clean/metrics.jsonl"), weights(clean)
    assert clean_trained == TRAINED

    def staggered(trainer):  # groups ready beyond trigger 0's own: all in step 1, 5 in step 2
        return PartialRollout(make_rollout(trainer.cfg, trainer.source, trainer.model_config), [9, 5])

    train_trigger = PPOTrainer.train_trigger

    def failing(self, batch, prox_logp=None):
        if (self.global_step, self.local_trigger_step) == (1, 2):
            assert prox_logp is None  # not scored ahead: it reads slot 0
            raise RolloutFailedError("the replay buffer died")
        return train_trigger(self, batch, prox_logp)

    monkeypatch.setattr(PPOTrainer, "train_trigger", failing)
    with pytest.raises(RolloutFailedError, match=r"the trainer's state at step 1, trigger 2 is checkpointed"):
        recording_run(filter_cfg(small_cfg, **{**common, "trainer.output_dir": out}), monkeypatch, staggered)
    monkeypatch.setattr(PPOTrainer, "train_trigger", train_trigger)
    path, state = ckpt.CheckpointDir(f"{out}/checkpoints").newest(lambda p, m: ckpt.load_torch(p / TRAINER_FILE))
    assert path.name == "step_00000001_trigger_2" and state["anchor"] is True  # trigger 2 reads slot 0
    pending = state["cycle"]["pending"]
    assert [g["index"] for g in pending["taken"]] == [15, 16] and pending["kept"] == [False, True]
    assert pending["discarded"] == 1 and state["cycle"]["ahead"] == []
    assert state["rollout"]["next_grant"] == 17  # group 17, drawn by the failed trigger, is drawn again

    resumed, resumed_trained = recording_run(
        filter_cfg(small_cfg, **{**common, "trainer.output_dir": out, "trainer.resume": True}), monkeypatch
    )
    assert resumed_trained == [[16, 17]]
    for name, tensor in weights(resumed).items():
        assert torch.equal(tensor, expected_weights[name]), name
    records = read_metrics(f"{out}/metrics.jsonl")
    assert [r["snapshot/scored_ahead_frac"] for r in records] == [1.0, 0.5]  # step 2: trigger 1's of 2 (clean: both)
    skip = ("timing_s/", "snapshot/scored_ahead_frac", "schedule/bytes")  # the staggered run took in other takes
    got, want = [
        [{k: v for k, v in r.items() if not k.startswith(skip)} for r in rs] for rs in (records, expected_records)
    ]
    assert [{k: (v, b.get(k)) for k, v in a.items() if b.get(k) != v} for a, b in zip(got, want)] == [{}] * len(want)


def test_a_tiny_run_with_the_filter_learns(small_cfg):
    """The copy task at length 2 with the demo's model: the filter drops groups all along (the real rule, no patch)
    and the sampled reward still rises from chance."""
    cfg = small_cfg(
        **{
            "task.length": 2,
            "trainer.total_steps": 40,
            "trainer.train_batch_size": 16,
            "rollout.n": 8,
            "rollout.groups_per_batch": 8,
            "actor.lr": 0.003,
            "trainer.eval_prompts": 16,
            "model.hidden_size": 64,
            "model.num_hidden_layers": 2,
            "model.num_attention_heads": 4,
            "model.intermediate_size": 128,
            "algorithm.filter_groups.enable": True,
            # the lr and step count were chosen with a constant lr (the defaults' cosine lowers it over this short run)
            "actor.optim.lr_scheduler_type": "constant",
            "actor.optim.lr_warmup_steps_ratio": 0,
        }
    )
    result = PPOTrainer(cfg).fit()
    rewards = [r["critic/score/mean"] for r in result.records]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.25, rewards
    assert all(r["filter_groups/kept_frac"] < 1.0 for r in result.records[-10:])  # groups were dropped, and replaced
    assert all(r["filter_groups/draws"] > 1.0 for r in result.records[-10:])
    assert result.evaluation["eval/accuracy"] > 0.25


# ---- the default limit, in process ---------------------------------------------------------------------------------

KEEPS = filter_groups.keeps  # the real rule


def examining(rule, examined: list[int], most: int = 100):
    """rule, recording the grant index of each group it is asked about into examined; AssertionError past `most`
    groups, so a draw that does not stop fails the test instead of hanging it."""

    def counting(group: Group, metric: str) -> bool:
        examined.append(group.index)
        if len(examined) > most:
            raise AssertionError(f"the draws went on past {most} groups")
        return rule(group, metric)

    return counting


def constant_task(length: int) -> Task:
    """The copy task's prompts with a reward of 0 for every response: no group ever varies."""
    copy = digit_task("constant", length, lambda d: d)
    return dataclasses.replace(copy, reward_fn=lambda prompts, responses, mask: np.zeros(len(prompts), np.float32))


@pytest.mark.parametrize("mode", ["sync", "separate_async"])
def test_a_constant_reward_ends_the_run_at_the_default_limit_with_one_line_and_exit_code_6(
    small_args, capsys, monkeypatch, mode
):
    """The real rule on a real constant reward (rollout worker processes in separate_async): trigger 0 takes 10 x 2
    groups, keeps none and the run stops; without the limit it would draw forever (here: past 100 groups)."""
    monkeypatch.setitem(TASKS, "constant", constant_task)
    examined = []
    monkeypatch.setattr(filter_groups, "keeps", examining(KEEPS, examined))
    overrides = {"task.name": "constant", "trainer.mode": mode, "trainer.checkpoint_every": 10}
    code = main(["train", *small_args(**overrides, **{"algorithm.filter_groups.enable": True})])
    lines = capsys.readouterr().err.strip().splitlines()
    assert examined == list(range(20)), f"{len(examined)} groups examined"
    assert code == 6, lines
    assert lines[-1] == (
        "dppo: error: algorithm.filter_groups kept none of the 20 groups a trigger drew (10 mini-batches' worth, its "
        "limit where max_num_gen_batches=0 sets none): reward was the same for every response of each (a constant "
        "reward, or a policy that answers these prompts alike); set algorithm.filter_groups.max_num_gen_batches > 0 "
        "to train on the last mini-batch at that limit instead, or enable=false; nothing was trained yet, so no "
        "checkpoint was written"
    )


def test_a_run_that_stops_keeping_groups_is_checkpointed_before_its_error(small_args, capsys, monkeypatch, tmp_path):
    """Groups 0-3 vary (step 1's), none after: step 2's trigger 0 draws 4 .. 23 and the run stops, its state at step
    1 checkpointed, where a resumed run would draw them again."""
    examined = []
    monkeypatch.setattr(filter_groups, "keeps", examining(lambda group, metric: group.index < 4, examined))
    filtered = {"algorithm.filter_groups.enable": True}
    code = main(["train", *small_args(**{"trainer.checkpoint_every": 10, "trainer.total_steps": 3, **filtered})])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert examined == list(range(24)), f"{len(examined)} groups examined"
    assert code == 6
    assert line.startswith("dppo: error: algorithm.filter_groups kept none of the 20 groups a trigger drew ")
    checkpoints = tmp_path / "run" / "checkpoints"
    assert line.endswith(
        f"; the trainer's state at step 1 is checkpointed in {checkpoints}/step_00000001 (trainer.resume=true "
        "continues from it)"
    )
    path, state = ckpt.CheckpointDir(checkpoints).newest(lambda p, m: ckpt.load_torch(p / TRAINER_FILE))
    assert path.name == "step_00000001" and state["rollout"]["next_grant"] == 4
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1]


def keep_one_in_twenty(group: Group, metric: str) -> bool:
    return group.index % 20 == 0


def test_at_the_default_limit_a_trigger_trains_on_the_groups_it_kept_with_one_warning_line_a_step(
    small_cfg, monkeypatch, caplog
):
    """One group in 20 varies: each trigger (G = 2) takes 20, keeps one and trains on it; score-ahead draws trigger
    1's 20 at trigger 0; the rollout counts one group consumed per trigger."""
    cfg = small_cfg(**{"algorithm.filter_groups.enable": True})
    with caplog.at_level(logging.WARNING, logger="dppo.trainer"):
        trainer, trained = recording_run(cfg, monkeypatch, rule=examining(keep_one_in_twenty, []))
    assert trained == [[0], [20], [40], [60]]
    records = read_metrics(trainer.metrics.path)
    assert [r["filter_groups/draws"] for r in records] == [10.0, 10.0]
    assert [r["filter_groups/kept_frac"] for r in records] == [0.05, 0.05]
    assert [r["filter_groups/at_limit"] for r in records] == [2.0, 2.0]  # both triggers of each step
    assert [r["snapshot/scored_ahead_frac"] for r in records] == [1.0, 1.0]
    assert (trainer.rollout_start.consumed, trainer.rollout_start.next_grant) == (4, 80)
    lines = [r.getMessage() for r in caplog.records if r.name == "dppo.trainer"]
    assert lines == [
        f"step {step}: a trigger kept 1 of the 20 groups it drew (10 mini-batches' worth, algorithm.filter_groups' "
        "limit where max_num_gen_batches=0 sets none) and trains on them instead of 2; filter_groups/at_limit counts "
        "such triggers per step"
        for step in (1, 2)
    ]
