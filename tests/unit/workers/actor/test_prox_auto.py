"""algorithm.prox_logp_method=auto's switch: checks on the first cycle and every prox_check_every cycles; a
failed check switches to recompute until a check passes again; where stale samples can come, a check that saw
no interpolated token cannot pass."""

import pytest

from dppo.workers.actor.prox_auto import INTERP_KEY, IS_ERR_KEY, AutoProxSwitch


def run(switch, errs, triggers=2, interp=0.5):
    """Drive one cycle per entry of errs (the IS-weight error loglinear makes that cycle, on a share interp of the
    tokens interpolated at trigger 1 on); return each cycle's (method used, checked, measured error or None)."""
    seen = []
    for err in errs:
        method = switch.method()
        for k in range(triggers):
            switch.record_trigger({IS_ERR_KEY: err, INTERP_KEY: interp if k else 0.0, "actor/pg_loss": 0.1})
        m = switch.end_cycle()
        assert m["prox_approx/method"] == {"loglinear": 0.0, "recompute": 1.0}[method]
        seen.append((method, bool(m["prox_approx/checked"]), m.get("prox_approx/check_is_err")))
    return seen


def test_checks_that_pass_stay_loglinear_between_checks():
    seen = run(AutoProxSwitch(check_every=3, max_is_err=0.01), [0.002] * 7)
    assert [s[0] for s in seen] == [
        "recompute",
        "loglinear",
        "loglinear",
        "recompute",
        "loglinear",
        "loglinear",
        "recompute",
    ]
    assert [s[1] for s in seen] == [True, False, False, True, False, False, True]
    assert seen[0][2] == 0.002 and seen[1][2] is None


def test_a_failed_check_switches_to_recompute_and_a_passing_one_back():
    errs = [0.002, 0.5, 0.5, 0.5, 0.03, 0.02, 0.004, 0.5, 0.5]
    seen = run(AutoProxSwitch(check_every=2, max_is_err=0.01), errs)
    # cycle 0 checks (passes), 1 loglinear, 2 checks (fails: 0.5), 3-5 recompute and check each cycle (0.5, 0.03,
    # 0.02 fail), 6 checks and passes (0.004), 7 loglinear (its 0.5 goes unseen), 8 checks and fails
    assert [s[0] for s in seen] == [
        "recompute",
        "loglinear",
        "recompute",
        "recompute",
        "recompute",
        "recompute",
        "recompute",
        "loglinear",
        "recompute",
    ]
    assert [s[2] for s in seen] == [0.002, None, 0.5, 0.5, 0.03, 0.02, 0.004, None, 0.5]


def test_the_worst_trigger_of_a_check_cycle_decides():
    switch = AutoProxSwitch(check_every=5, max_is_err=0.01)
    for err in (0.001, 0.02, 0.001):
        switch.record_trigger({IS_ERR_KEY: err, INTERP_KEY: 0.5})
    assert switch.end_cycle()["prox_approx/check_is_err"] == 0.02
    assert switch.method() == "recompute"


def test_a_check_without_interpolated_tokens_cannot_pass_where_stale_samples_come():
    """The first cycle of an async run: every sample is as new as pi_prox, so loglinear's error is 0 by
    construction and says nothing; the checks go on until one sees interpolated tokens."""
    switch = AutoProxSwitch(check_every=3, max_is_err=0.01)
    seen = run(switch, [0.0, 0.0], interp=0.0)
    assert seen == [("recompute", True, 0.0), ("recompute", True, 0.0)]
    seen = run(switch, [0.004, 0.004, 0.004, 0.02], interp=0.25)
    assert [s[0] for s in seen] == ["recompute", "loglinear", "loglinear", "recompute"]
    assert run(switch, [0.5], interp=0.0)[0][0] == "recompute" and switch.method() == "recompute"  # fails still


def test_in_sync_mode_a_check_passes_on_the_rollouts_numerics():
    seen = run(AutoProxSwitch(check_every=3, max_is_err=0.01, stale_samples=False), [0.0, 0.0, 0.0], interp=0.0)
    assert [s[0] for s in seen] == ["recompute", "loglinear", "loglinear"]


def test_a_check_cycle_without_triggers_checks_again():
    switch = AutoProxSwitch(check_every=2, max_is_err=0.01)
    assert "prox_approx/check_is_err" not in switch.end_cycle()
    assert switch.is_check_cycle()


def test_errors():
    with pytest.raises(ValueError, match="algorithm.prox_check_every must be an int >= 1; got 0"):
        AutoProxSwitch(check_every=0, max_is_err=0.01)
    with pytest.raises(ValueError, match="algorithm.prox_max_is_err must be a finite number > 0; got nan"):
        AutoProxSwitch(check_every=1, max_is_err=float("nan"))
    with pytest.raises(KeyError, match="a check cycle's metrics must carry prox_approx/is_weight_abs_err_mean"):
        AutoProxSwitch(check_every=1, max_is_err=0.01).record_trigger({"actor/pg_loss": 0.1})


# ---- on a rank: the switch drives the old-log-prob strategy and the prox method ------------------------


def run_auto(small_cfg, lr, cycles, fresh_from=None):
    """cycles sync cycles of 2 triggers with prox_logp_method=auto, checking every 2 cycles, on one batch stamped
    with each cycle's version (so loglinear takes pi_behav as pi_prox): its behavior log-probs are the initial
    weights', or the cycle-start weights' from cycle fresh_from on (as fresh samples would be). Returns each
    cycle's per-trigger metrics and the forward passes the cycle ran."""
    from tests.unit.workers.actor.test_prox_method import (
        count_forwards,
        make_batch,
        make_rank,
    )

    rank = make_rank(
        small_cfg,
        **{
            "algorithm.prox_logp_method": "auto",
            "algorithm.prox_check_every": 2,
            "trainer.parameter_sync_step": 2,
            "trainer.train_batch_size": 8,
            "actor.lr": lr,
        },
    )
    assert rank.pi_old.source.name == "slot" and rank.pi_old.method.name == "auto"
    batch, adv = make_batch(rank.model)
    batch.behav_logp = rank.score(rank.model, batch)
    per_cycle = []
    for cycle in range(cycles):
        batch.versions[:] = cycle
        if fresh_from is not None and cycle >= fresh_from:
            batch.behav_logp = rank.score(rank.model, batch)
        calls = count_forwards(rank.model)
        metrics = [rank.update_actor(trigger, batch, adv, cycle) for trigger in range(2)]
        per_cycle.append((metrics, len(calls)))
    rank.close()
    return per_cycle


def methods_and_errors(per_cycle):
    return (
        [[m["prox_approx/method"] for m in metrics] for metrics, _ in per_cycle],
        [metrics[1].get("prox_approx/is_weight_abs_err_mean") for metrics, _ in per_cycle],
    )


def test_auto_on_a_rank_stays_loglinear_while_checks_pass(small_cfg):
    per_cycle = run_auto(small_cfg, lr=1e-6, cycles=4)
    methods, errs = methods_and_errors(per_cycle)
    assert methods == [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0]]  # checks on cycles 0 and 2 only
    assert errs[0] < 0.01 and errs[2] < 0.01 and errs[1] is None and errs[3] is None
    # a check cycle reads slot 0 at trigger 1: a pass over the 11 sequences (3 micro-batches of 4) more than a
    # loglinear cycle's training passes (2 triggers x 3)
    assert (per_cycle[0][1], per_cycle[1][1]) == (9, 6)


def test_auto_on_a_rank_switches_to_recompute_and_back(small_cfg):
    per_cycle = run_auto(small_cfg, lr=0.5, cycles=6, fresh_from=4)
    methods, errs = methods_and_errors(per_cycle)
    # cycle 0's check passes (pi_behav is the initial weights, pi_prox too); cycle 2's fails (the weights moved,
    # the samples did not), so 3 recomputes and checks (fails again); from 4 on the samples are fresh: 4's check
    # passes and 5 runs loglinear
    assert methods == [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]
    assert errs[0] < 0.01 and errs[2] > 0.01 and errs[3] > 0.01 and errs[4] < 0.01
    for metrics, _ in per_cycle:  # each trigger logs whether its cycle checks, and the worst trigger's error so far
        checked = metrics[0]["prox_approx/method"] == 1.0
        assert [m["prox_approx/checked"] for m in metrics] == [float(checked)] * 2
        if checked:
            assert metrics[1]["prox_approx/check_is_err_max"] == max(m[IS_ERR_KEY] for m in metrics)
        else:
            assert "prox_approx/check_is_err_max" not in metrics[1]
