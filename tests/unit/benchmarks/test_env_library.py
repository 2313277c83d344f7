"""benchmarks/env_library.py's pure parts: the checks of a run's metrics records (what `make bench-envs` asserts of
each environment's 3 steps) and its table. (The runs themselves are `make bench-envs`: minutes on the real model.)"""

from __future__ import annotations

import pytest
from bench_scripts import load_bench  # tests/bench_scripts.py (tests/conftest.py puts tests/ on sys.path)


@pytest.fixture(scope="module")
def bench():
    yield from load_bench("env_library")


def record(step: int, **changed) -> dict:
    """A step's record of a tool environment's run that passes every check; changed: keys replaced (None: removed)."""
    r = {
        "step": step,
        "critic/score/mean": 0.25,
        "agent/correct_answer": 0.25,
        "agent/turns_mean": 1.75,
        "agent/num_turns": 1.75,
        "agent/calculator_calls": 0.75,
        "agent/tool_parse_failures": 1.0,
        "agent/errors": 0.0,
        "agent/retokenize_mismatch": 0.0,
        "timing_s/step": 41.5,
    }
    r.update(changed)
    return {k: v for k, v in r.items() if v is not None}


def test_a_run_that_shows_everything_passes(bench):
    for env in bench.ENVS.values():
        assert bench.checks(env, [record(1), record(2), record(3)], steps=3) == []


@pytest.mark.parametrize(
    "env, changed, expected",
    [
        ("multi_turn", {"agent/turns_mean": 1.0}, "step 2: agent/turns_mean = 1.0, expected > 1 (multi-turn)"),
        ("multi_turn", {"agent/turns_mean": None}, "step 2: agent/turns_mean = None, expected > 1 (multi-turn)"),
        ("multi_turn", {"agent/errors": 2.0}, "step 2: agent/errors = 2.0, expected 0"),
        ("tool", {"agent/retokenize_mismatch": 1.0}, "step 2: agent/retokenize_mismatch = 1.0, expected 0"),
        ("multi_turn", {"agent/errors": None}, "step 2: agent/errors = None, expected 0"),
        ("tool", {"agent/correct_answer": None}, "step 2: no reward (critic/score/mean 0.25, agent/correct_answer)"),
        ("tool", {"critic/score/mean": float("nan")}, "step 2: no reward (critic/score/mean nan, agent/correct_answer)"),
    ],
)  # fmt: skip
def test_each_missing_figure_fails_its_check_naming_the_step(bench, env, changed, expected):
    assert bench.checks(bench.ENVS[env], [record(1), record(2, **changed), record(3)], steps=3) == [expected]


def test_the_tool_env_needs_tool_calls_and_second_turns_over_the_run_not_at_every_step(bench):
    env = bench.ENVS["tool"]
    none = {"agent/calculator_calls": 0.0, "agent/turns_mean": 1.0}
    assert bench.checks(env, [record(1, **none), record(2), record(3, **none)], steps=3) == []
    assert bench.checks(env, [record(1, **none), record(2, **none), record(3, **none)], steps=3) == [
        "the run: mean agent/calculator_calls = 0.0, expected > 0",
        "the run: mean agent/turns_mean = 1.0, expected > 1",
    ]
    missing = {"agent/calculator_calls": None}
    assert bench.checks(env, [record(1, **missing)], steps=1) == [
        "the run: mean agent/calculator_calls = 0.0, expected > 0"
    ]


def test_the_multi_turn_env_needs_no_tool_calls_and_a_short_run_fails(bench):
    assert bench.checks(bench.ENVS["multi_turn"], [record(1, **{"agent/calculator_calls": 0.0})], steps=1) == []
    assert bench.checks(bench.ENVS["tool"], [record(1), record(2)], steps=3) == ["steps [1, 2], expected 1..3"]


def test_the_table_has_a_line_per_step_and_dashes_for_missing_figures(bench):
    lines = bench.table([record(1), record(2, **{"agent/calculator_calls": None})])
    assert len(lines) == 3
    assert lines[0].split()[:3] == ["step", "reward", "turns"]
    assert lines[1].split()[:4] == ["1", "0.250", "1.750", "1.750"]
    assert lines[2].split()[4] == "-"  # calc calls
