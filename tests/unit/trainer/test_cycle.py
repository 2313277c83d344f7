"""The sync cycle without Ray: which weights pi_old uses, that computing it never moves the live weights,
that parameter_sync_step=1 takes no snapshot, and that a failure inside it leaves all state intact."""

import copy
import dataclasses

import pytest
import torch

from dppo.config.pi_old import choose_pi_old
from dppo.trainer.ppo import PPOTrainer
from dppo.workers.actor.pi_old_sources import SlotSource


def params_of(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def optimizer_state_of(optimizer):
    return copy.deepcopy(optimizer.state_dict())


def assert_params_equal(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def assert_optimizer_state_equal(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for index, tensors in a["state"].items():
        for key, value in tensors.items():
            assert torch.equal(value, b["state"][index][key]), (index, key)


class ProbeTrainer(PPOTrainer):
    """Records, around every old-log-prob computation, what an independent reference says the old log-probs the
    loss uses should be (they come from a separate pass, or from the training forward pass itself)."""

    def setup(self):
        super().setup()
        self.checks = []
        rank = self.actor_group.local_rank  # ray.enabled=false: the one actor rank, in this process
        source = rank.pi_old.source
        inner, inner_used = source.compute, rank.pi_old.record_used

        def compute(trigger, batch):
            if trigger == 0:
                self.anchor = copy.deepcopy(rank.model)  # the cycle-start weights, independent of any snapshot
            before = params_of(rank.model)
            logp = inner(trigger, batch)
            after = params_of(rank.model)
            self.pending = {
                "step": self.global_step,
                "trigger": trigger,
                "separate_pass": logp is not None,
                "live_unchanged": all(torch.equal(before[k], after[k]) for k in before),
                "expected": rank.score(self.anchor, batch),
                "live": rank.score(rank.model, batch),
            }  # fmt: skip
            return logp

        def record_used(batch, prox_logp):
            inner_used(batch, prox_logp)
            check = self.pending
            check["equal_to_anchor"] = torch.equal(prox_logp, check.pop("expected"))
            check["live_differs"] = not torch.equal(check.pop("live"), prox_logp)
            self.checks.append(check)

        source.compute, rank.pi_old.record_used = compute, record_used


def cycle_cfg(small_cfg, ps, bypass, **extra):
    return small_cfg(**{
        "trainer.parameter_sync_step": ps,
        "trainer.train_batch_size": 2 * ps,
        "trainer.total_steps": 2,
        "algorithm.rollout_correction.bypass_mode": bypass,
        "actor.lr": 0.05,  # large steps: the live weights move visibly between triggers
        # these tests are about slot 0: in sync mode score-ahead would score every later mini-batch at trigger 0
        # instead of reading it (test_score_ahead.py)
        "snapshot.score_ahead": False,
        **extra,
    })  # fmt: skip


@pytest.mark.parametrize("bypass", [False, True])
@pytest.mark.parametrize("ps", [1, 2, 4])
def test_old_log_probs_are_the_cycle_start_policy_bitwise(small_cfg, ps, bypass):
    trainer = ProbeTrainer(cycle_cfg(small_cfg, ps, bypass))
    trainer.fit()
    assert [(c["step"], c["trigger"]) for c in trainer.checks] == [(s, k) for s in range(2) for k in range(ps)]
    for check in trainer.checks:
        assert check["equal_to_anchor"], check
        assert check["live_unchanged"], check
        if check["trigger"] > 0:
            assert check["live_differs"], "the live weights must have moved, or the test proves nothing"
        # a pass of its own only where pi_old is not the live weights (bypass: the behavior log-probs, no pass)
        assert check["separate_pass"] == (bypass or check["trigger"] > 0), check


@pytest.mark.parametrize("strategy", ["auto", "view", "swap", "stream", "reference"])
def test_each_snapshot_strategy_gives_the_cycle_start_policy_bitwise(small_cfg, strategy):
    trainer = ProbeTrainer(cycle_cfg(small_cfg, 4, False, **{"snapshot.strategy": strategy}))
    trainer.fit()
    assert len(trainer.checks) == 8
    assert all(c["equal_to_anchor"] and c["live_unchanged"] for c in trainer.checks), trainer.checks
    source = trainer.actor_group.local_rank.pi_old.source
    if strategy == "reference":
        assert source.name == "reference" and source.pool is None
    else:  # the reader really went through the pool
        reader = {"auto": "view"}.get(strategy, strategy)  # auto on the CPU: the slot in place
        assert source.reader_name == reader
        if reader == "stream":  # the pool counts each pass, even though on the CPU it copies nothing
            assert source.stream.passes == 12  # 2 cycles x 3 triggers x 2 micro-batches of <= 5
            assert source.pool.stats()["stream"]["count"] == 12
        else:
            assert source.pool.stats()[reader]["count"] > 0


@pytest.mark.parametrize("ps", [2, 4])
def test_decoupled_takes_one_snapshot_per_cycle(small_cfg, ps):
    trainer = ProbeTrainer(cycle_cfg(small_cfg, ps, False))
    source = trainer.actor_group.local_rank.pi_old.source
    pool = source.pool
    assert source.name == "slot" and pool is not None
    trainer.fit()
    assert pool.stats()["save"]["count"] == 2


@pytest.mark.parametrize("bypass, anchor", [(False, "cycle_start"), (True, "cycle_start"), (False, "current")])
def test_ps1_and_bypass_and_current_take_no_snapshot(small_cfg, bypass, anchor):
    trainer = PPOTrainer(
        cycle_cfg(
            small_cfg, 1 if anchor == "cycle_start" and not bypass else 2, bypass, **{"algorithm.prox_anchor": anchor}
        )
    )
    source = trainer.actor_group.local_rank.pi_old.source
    assert source.pool is None
    assert not isinstance(source, SlotSource)


def test_the_ranks_build_pi_old_from_the_choice_they_are_handed(small_cfg):
    """The trainer hands its PiOldChoice to the ranks as it is, and no rank chooses pi_old from the config itself: a
    choice other than the config's (the swap reader where the config says view) is the one the provider is built
    from, at the start and again after a checkpoint is loaded (which builds the provider anew)."""
    cfg = cycle_cfg(small_cfg, 2, False, **{"snapshot.strategy": "view"})
    handed = dataclasses.replace(choose_pi_old(cfg), reader="swap")
    trainer = PPOTrainer(cfg, pi_old_choice=handed)
    rank = trainer.actor_group.local_rank
    assert trainer.pi_old_choice is handed and rank.pi_old.choice is handed
    assert rank.pi_old.source.reader_name == "swap"
    path = trainer.save_checkpoint()
    trainer.actor_group.load_checkpoint(str(path / "actor"))
    assert rank.pi_old.choice is handed and rank.pi_old.source.reader_name == "swap"
    trainer.close()


@pytest.mark.parametrize("strategy", ["view", "swap", "stream", "reference"])
@pytest.mark.parametrize("fail_at", [0, 1, 3])
def test_exception_in_old_log_prob_leaves_weights_and_optimizer_intact(small_cfg, strategy, fail_at):
    trainer = PPOTrainer(cycle_cfg(small_cfg, 4, False, **{"trainer.total_steps": 1, "snapshot.strategy": strategy}))
    rank = trainer.actor_group.local_rank
    state = {}
    inner = rank.pi_old.source.compute

    def boom(module, args, kwargs):
        raise RuntimeError("injected failure in the pi_old forward pass")

    def compute(trigger, batch):
        if trigger == fail_at:
            state["params"], state["optimizer"] = params_of(rank.model), optimizer_state_of(rank.optimizer)
            rank.model.register_forward_pre_hook(boom, with_kwargs=True)
        return inner(trigger, batch)

    rank.pi_old.source.compute = compute
    with pytest.raises(RuntimeError, match="injected failure"):
        trainer.fit()
    assert_params_equal(state["params"], params_of(rank.model))
    assert_optimizer_state_equal(state["optimizer"], optimizer_state_of(rank.optimizer))
    if fail_at > 0 and strategy != "reference":
        assert rank.pi_old.source.reader_name == strategy


@pytest.mark.parametrize("anchor", ["cycle_start", "current"])
def test_verify_old_log_prob_logs_exact_zero_on_cpu(small_cfg, anchor):
    """Slot 0's old log-probs, and the training forward's own where pi_old is the live weights (trigger 0, and
    every trigger of prox_anchor=current), against a deep copy of pi_old's weights."""
    trainer = PPOTrainer(
        cycle_cfg(small_cfg, 4, False, **{"trainer.verify_old_log_prob": True, "algorithm.prox_anchor": anchor})
    )
    result = trainer.fit()
    diffs = [r["debug/old_log_prob_max_abs_diff"] for r in result.records]
    assert diffs == [0.0, 0.0]


def test_verify_old_log_prob_reports_old_log_probs_that_are_off_and_resets_each_cycle(small_cfg):
    trainer = PPOTrainer(cycle_cfg(small_cfg, 4, False, **{"trainer.verify_old_log_prob": True}))
    inner = trainer.actor_group.local_rank.pi_old.source
    compute = inner.compute

    def off_in_the_first_cycle(trigger, batch):
        logp = compute(trigger, batch)
        return logp + 0.25 if trainer.global_step == 0 and trigger == 2 else logp

    inner.compute = off_in_the_first_cycle
    result = trainer.fit()
    diffs = [r["debug/old_log_prob_max_abs_diff"] for r in result.records]
    assert diffs[0] == pytest.approx(0.25, abs=1e-6) and diffs[1] == 0.0


def test_metrics_of_a_cycle(small_cfg):
    result = PPOTrainer(cycle_cfg(small_cfg, 2, False)).fit()
    record = result.records[-1]
    for key in (
        "step",
        "critic/score/mean",
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "staleness/mean",
        "timing_s/step",
        "timing_s/gen_wait",
        "timing_s/old_log_prob",
        "timing_s/snapshot",
        "timing_s/update_actor",
        "rollout_corr/weight_mean",
        "rollout_corr/kl_k1",
    ):
        assert key in record, key
    assert record["step"] == 2 and record["version"] == 2
    assert record["staleness/mean"] == 0.0 and record["staleness/max"] == 0.0  # sync: always the current version
    assert record["timing_s/step"] >= record["timing_s/update_actor"] + record["timing_s/old_log_prob"]


def test_unknown_reader_and_source_names_list_the_valid_ones(small_cfg):
    from dppo.config.pi_old import PiOldChoice
    from dppo.workers.actor.pi_old_sources import UnknownReaderError

    rank = PPOTrainer(cycle_cfg(small_cfg, 2, False)).actor_group.local_rank
    with pytest.raises(UnknownReaderError, match="'fast'.*view, swap, stream"):
        rank.pi_old.source.use_reader("fast")
    with pytest.raises(KeyError, match="'nope'.*behav, live, slot, reference, none"):
        PiOldChoice(source="nope")
