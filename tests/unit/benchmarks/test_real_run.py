"""benchmarks/real_run.py's pure parts: the evaluations among stamped metrics records, the time and step to a threshold,
and the before/after report. (The run itself is `make real`: minutes on the real model, not a test.)"""

from __future__ import annotations

import json

import pytest
from bench_scripts import load_bench  # tests/bench_scripts.py (tests/conftest.py puts tests/ on sys.path)


@pytest.fixture(scope="module")
def bench():
    yield from load_bench("real_run")


def records(bench, accs: dict[int, float], steps: int = 6) -> list[tuple[dict, float]]:
    """Stamped records of `steps` steps 30 s apart after 40 s of start-up, with the held-out accuracy at the steps
    of accs."""
    out = []
    for step in range(1, steps + 1):
        record = {"step": step, "critic/score/mean": 0.1 * step, "timing_s/step": 30.0}
        if step in accs:
            record[bench.ACC_KEY] = accs[step]
        out.append((record, 40.0 + 30.0 * step))
    return out


def test_the_evaluations_are_the_stamped_records_that_hold_the_accuracy(bench):
    stamped = records(bench, {2: 0.3, 4: 0.55, 6: 0.72})
    points = bench.eval_points(stamped)
    assert [(p.step, p.at_s, p.acc) for p in points] == [(2, 100.0, 0.3), (4, 160.0, 0.55), (6, 220.0, 0.72)]


def test_time_to_a_threshold_is_the_first_evaluation_at_or_above_it(bench):
    points = bench.eval_points(records(bench, {2: 0.5, 4: 0.45, 6: 0.7}))
    assert bench.time_to(points, 0.5) == 100.0 and bench.step_to(points, 0.5) == 2  # equal counts; a later dip does not
    assert bench.time_to(points, 0.7) == 220.0 and bench.step_to(points, 0.7) == 6
    assert bench.time_to(points, 0.8) is None and bench.step_to(points, 0.8) is None
    assert bench.time_to([], 0.5) is None


def test_the_report_gives_before_after_figures_crossings_against_the_targets_and_outputs(bench):
    points = bench.eval_points(records(bench, {2: 0.3, 4: 0.55, 6: 0.68}))
    report = bench.Report(
        "vllm",
        base_greedy=0.16,
        base_pass_at_8=0.45,
        base_sampled=0.09,
        base_s=35.0,
        final_greedy=0.68,
        points=points,
        wall_s=240.0,
        import_s=20.0,
        steps=6,
        outputs={"hf_model": "outputs/real/hf_model"},
    )
    crossings = report.crossings()
    assert crossings["0.5"] == {"at_s": 160.0, "step": 4, "target_s": 300.0, "met": True}
    assert crossings["0.7"] == {"at_s": None, "step": None, "target_s": 1800.0, "met": False}
    rows = dict(report.rows())
    assert rows["base model, held-out greedy accuracy"] == "0.160"
    assert rows["base model, pass@8 at temperature 1"] == "0.450"
    assert rows["trained, held-out greedy accuracy (final)"] == "0.680"
    assert rows["time to greedy accuracy 0.5"] == "160 s (step 4); target 300 s: met"
    assert rows["time to greedy accuracy 0.7"] == "not reached; target 1800 s: NOT met"
    assert rows["held-out greedy accuracy by step"] == "2:0.300@100s 4:0.550@160s 6:0.680@220s"
    assert (
        rows["model import, not counted (s)"] == "20"
        and rows["the base measurement (s)"] == "35"
        and rows["hf_model"] == "outputs/real/hf_model"
    )
    lines = report.lines()
    assert len(lines) == len(rows) and all(line.startswith("  ") for line in lines)
    written = json.loads(json.dumps(report.to_json()))
    assert written["crossings"]["0.5"]["at_s"] == 160.0 and written["points"][1] == {
        "step": 4,
        "at_s": 160.0,
        "acc": 0.55,
    }
    assert written["base_pass_at_8"] == 0.45 and written["final_greedy"] == 0.68


def test_a_missing_figure_reads_n_a(bench):
    report = bench.Report("hf", None, None, None, 0.0, None)
    rows = dict(report.rows())
    assert rows["base model, held-out greedy accuracy"] == "n/a" and rows["held-out greedy accuracy by step"] == "-"
    assert rows["time to greedy accuracy 0.5"] == "not reached; target 300 s: NOT met"


def test_the_yamls_auto_precision_is_decided_once_for_the_base_measurement_and_the_training_alike(bench):
    """make real's YAML says auto for both keys; real_run decides them once (a fake machine here) and passes the
    result as overrides to both processes, and the report says what was run; set keys pass through."""
    from dppo.config import load_config
    from dppo.launch.precision import Machine

    yaml_cfg = load_config([], config_file=str(bench.CONFIG))
    assert (yaml_cfg.actor.mixed_precision, yaml_cfg.rollout.dtype) == ("auto", "auto")
    assert bench.engine_overrides("vllm") == ["rollout.name=vllm"]  # no dtype of its own any more
    slow = Machine(False, False, frozenset({"avx512_bf16"}), lambda: 0.57)
    keys, line = bench.precision_overrides(bench.CONFIG, ["rollout.name=hf"], slow)
    assert keys == ["actor.mixed_precision=null", "rollout.dtype=float32"]
    assert line == (
        "precision: actor.mixed_precision=auto -> null, rollout.dtype=auto -> float32 "
        "(CPU without AMX: bf16 matmul 0.57x fp32)"
    )
    fast = Machine(False, False, frozenset({"amx_bf16"}), lambda: 6.0)
    assert bench.precision_overrides(bench.CONFIG, [], fast)[0] == [
        "actor.mixed_precision=bfloat16",
        "rollout.dtype=bfloat16",
    ]
    given = ["actor.mixed_precision=bfloat16", "rollout.dtype=float32"]
    assert bench.precision_overrides(bench.CONFIG, given, slow) == (given, None)  # a user's keys stand
    report = bench.Report("hf", None, None, None, 0.0, None, precision=line)
    rows = dict(report.rows())
    assert rows["precision"] == line.removeprefix("precision: ")
