"""algorithm.prox_logp_method=auto's switch: checks on the first cycle and every prox_check_every cycles; a
failed check switches to recompute until a check passes again."""

import pytest

from dppo.workers.actor.prox_auto import IS_ERR_KEY, AutoProxSwitch


def run(switch, errs, triggers=2):
    """Drive one cycle per entry of errs (the IS-weight error loglinear makes that cycle); return each cycle's
    (method used, checked, measured error or None)."""
    seen = []
    for err in errs:
        method = switch.method()
        for _ in range(triggers):
            switch.record_trigger({IS_ERR_KEY: err, "actor/pg_loss": 0.1})
        m = switch.end_cycle()
        assert m["prox_approx/method"] == {"loglinear": 0.0, "recompute": 1.0}[method]
        seen.append((method, bool(m["prox_approx/checked"]), m.get("prox_approx/check_is_err")))
    return seen


def test_checks_that_pass_stay_loglinear_between_checks():
    seen = run(AutoProxSwitch(check_every=3, max_is_err=0.01), [0.002] * 7)
    assert [s[0] for s in seen] == ["recompute", "loglinear", "loglinear", "recompute", "loglinear", "loglinear",
                                    "recompute"]  # fmt: skip
    assert [s[1] for s in seen] == [True, False, False, True, False, False, True]
    assert seen[0][2] == 0.002 and seen[1][2] is None


def test_a_failed_check_switches_to_recompute_and_a_passing_one_back():
    errs = [0.002, 0.5, 0.5, 0.5, 0.03, 0.02, 0.004, 0.5, 0.5]
    seen = run(AutoProxSwitch(check_every=2, max_is_err=0.01), errs)
    # cycle 0 checks (passes), 1 loglinear, 2 checks (fails: 0.5), 3-5 recompute and check each cycle (0.5, 0.03,
    # 0.02 fail), 6 checks and passes (0.004), 7 loglinear (its 0.5 goes unseen), 8 checks and fails
    assert [s[0] for s in seen] == ["recompute", "loglinear", "recompute", "recompute", "recompute", "recompute",
                                    "recompute", "loglinear", "recompute"]  # fmt: skip
    assert [s[2] for s in seen] == [0.002, None, 0.5, 0.5, 0.03, 0.02, 0.004, None, 0.5]


def test_the_worst_trigger_of_a_check_cycle_decides():
    switch = AutoProxSwitch(check_every=5, max_is_err=0.01)
    for err in (0.001, 0.02, 0.001):
        switch.record_trigger({IS_ERR_KEY: err})
    assert switch.end_cycle()["prox_approx/check_is_err"] == 0.02
    assert switch.method() == "recompute"


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
