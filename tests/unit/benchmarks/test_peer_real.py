"""benchmarks/peer_real.py's pure parts: time to a threshold, medians over seeds, the verdicts against issue 35's
targets, and the problems written for TRL's side being the ones dppo's source trains and evaluates on. (The race
itself is `make bench-peers-real`: an hour on the real model, not a test.)"""

from __future__ import annotations

import json

import pytest
from bench_scripts import load_bench  # tests/bench_scripts.py (tests/conftest.py puts tests/ on sys.path)


@pytest.fixture(scope="module")
def bench():
    yield from load_bench("peer_real")


def run(bench, system: str, seed: int, accs: list[float], whole_s: float = 500.0):
    """A run with an evaluation every 2 steps, 30 s apart after 60 s, at the accuracies accs."""
    points = [(2 * (i + 1), 60.0 + 30.0 * i, acc) for i, acc in enumerate(accs)]
    return bench.Run(system, seed, points, whole_s, accs[-1], 2 * len(accs))


def test_a_run_reaches_a_threshold_at_its_first_evaluation_at_or_above_it(bench):
    r = run(bench, "dppo", 0, [0.3, 0.5, 0.45, 0.71])
    assert r.time_to(0.5) == 90.0 and r.time_to(0.7) == 150.0 and r.time_to(0.8) is None
    assert r.summary() == {"to_0.5_s": 90.0, "to_0.7_s": 150.0, "whole_s": 500.0, "final_acc": 0.71, "best_acc": 0.71}


def test_a_median_over_seeds_has_no_time_when_one_seed_never_got_there(bench):
    assert bench.median([100.0, 200.0, 150.0]) == 150.0
    assert bench.median([100.0, None]) is None
    assert bench.median([]) is None


def test_the_verdicts_are_the_ratios_of_the_medians_against_the_targets(bench):
    dppo = bench.medians([run(bench, "dppo", 0, [0.3, 0.5, 0.6]), run(bench, "dppo", 1, [0.5, 0.55, 0.58])])
    trl = bench.medians([run(bench, "trl", 0, [0.2, 0.3, 0.5], 900.0), run(bench, "trl", 1, [0.2, 0.4, 0.5], 700.0)])
    assert dppo["to_0.5_s"] == 75.0 and trl["to_0.5_s"] == 120.0 and trl["whole_s"] == 800.0
    v = bench.verdicts(dppo, trl)
    assert v["to_0.5_s"]["ratio"] == pytest.approx(0.625) and not v["to_0.5_s"]["met"]  # 0.625 > 0.6
    assert v["whole_s"]["ratio"] == pytest.approx(500 / 800) and v["whole_s"]["met"]
    assert v["final_acc"]["met"]  # median final 0.59 against 0.5
    slower = bench.verdicts({**dppo, "final_acc": 0.4}, trl)
    assert not slower["final_acc"]["met"]


def test_only_dppo_reaching_a_threshold_meets_it_and_neither_reaching_it_does_not(bench):
    trl_never = {"to_0.5_s": None, "whole_s": 800.0, "final_acc": 0.4}
    assert bench.verdicts({"to_0.5_s": 90.0, "whole_s": 500.0, "final_acc": 0.5}, trl_never)["to_0.5_s"]["met"]
    neither = bench.verdicts({"to_0.5_s": None, "whole_s": 500.0, "final_acc": 0.5}, trl_never)["to_0.5_s"]
    assert not neither["met"] and neither["ratio"] is None


def test_trl_gets_the_problems_of_dppo_s_source(bench, tmp_path, monkeypatch):
    pytest.importorskip("reasoning_gym")
    from dppo.config import load_config
    from dppo.data.reasoning_gym import generate, split_entries

    config = tmp_path / "run.yaml"
    config.write_text(
        f"model:\n  path: {tmp_path}\n"  # needed by the config's checks; the problems do not read it
        "trainer:\n  train_batch_size: 8\n  parameter_sync_step: 4\nrollout:\n  n: 8\nactor:\n  lr: 3.0e-5\n"
        "data:\n  max_response_length: 12\n  source: reasoning_gym\n  reasoning_gym:\n    dataset: basic_arithmetic\n"
        "    config: {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}\n"
        "    size: 60\n    seed: 5\n    val_size: 40\n    prompt_suffix: Answer with just the number.\n"
    )
    task = bench.write_task(tmp_path / "task.json", config)
    assert json.loads((tmp_path / "task.json").read_text()) == task
    rg = load_config([], config_file=config).data.reasoning_gym
    train, val = split_entries(rg, 0)
    as_json = json.loads(json.dumps([train, val]))  # the entries' tuples (difficulty ranges) as JSON lists
    assert [json.loads(row["entry"]) for row in task["train"]] == as_json[0]
    assert [json.loads(row["entry"]) for row in task["val"]] == as_json[1]
    # one-digit sums repeat: some training problems are held-out ones and are left out, as the source leaves them
    assert len(train) < 60 and not {e["question"] for e in train} & {e["question"] for e in val}
    assert len(generate("basic_arithmetic", rg.config, 60, 5)) == 60
    assert task["train"][0]["prompt"] == f"{train[0]['question']} Answer with just the number."
    assert task["dataset"] == "basic_arithmetic" and task["config"]["max_digits"] == 1
    assert task["lr"] == 3e-5 and task["steps_per_generation"] == 4  # TRL runs the config's lr and cycle


def test_a_config_trl_s_side_does_not_match_is_refused(bench, tmp_path):
    pytest.importorskip("reasoning_gym")
    config = tmp_path / "run.yaml"
    config.write_text(
        f"model:\n  path: {tmp_path}\ntrainer:\n  train_batch_size: 16\nrollout:\n  n: 8\n"
        "data:\n  source: reasoning_gym\n  reasoning_gym:\n    dataset: basic_arithmetic\n    size: 20\n"
    )
    with pytest.raises(SystemExit, match="trainer.train_batch_size=16, but trl_real.py runs 8"):
        bench.write_task(tmp_path / "task.json", config)
    assert not (tmp_path / "task.json").exists()
