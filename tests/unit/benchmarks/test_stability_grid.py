"""benchmarks/stability_grid.py's pure parts: each setting's overrides are a valid `dppo train` config, a run's
figures, the table's counts, medians and ratios, and a grid that resumes without running a finished run again.
(The grid itself takes hours; `make bench-stability` runs it.)"""

from __future__ import annotations

import json

import pytest
from bench_scripts import load_bench  # tests/bench_scripts.py (tests/conftest.py puts tests/ on sys.path)

from dppo.config import load_config


@pytest.fixture(scope="module")
def grid():
    yield from load_bench("stability_grid")


def test_every_setting_is_a_valid_run_of_the_demo_without_ray(grid, tmp_path):
    for setting in grid.SETTINGS:
        for ps in grid.SYNC_STEPS:
            cfg = load_config(grid.overrides(setting, ps, 3, tmp_path / "run"))
            assert (cfg.trainer.seed, cfg.trainer.parameter_sync_step, cfg.ray.enabled) == (3, ps, False)
            assert cfg.trainer.output_dir == str(tmp_path / "run") and cfg.trainer.total_steps == 60  # the demo's
    assert load_config(grid.overrides("baseline", 4, 0, tmp_path)).actor.max_ppo_kl is None
    combined = load_config(grid.overrides("schedule_and_guard", 8, 0, tmp_path))
    assert combined.actor.max_ppo_kl is not None and combined.actor.optim.lr_scheduler_type == "cosine"


def test_a_runs_figures(grid):
    records = [{"step": k, "critic/score/mean": r} for k, r in enumerate([0.1] * 9 + [0.95] * 10 + [0.5], 1)]
    stamps = [(r["step"], r["critic/score/mean"], 5.0 + r["step"]) for r in records]
    result = grid.result_of(
        "kl_guard", 8, 2, {"evaluation": {"eval/accuracy": 0.574, "eval/reward": 0.9}}, records, stamps, 0, 40.0
    )
    assert result["exact"] == 0.574 and result["to_0.9_s"] == 15.0  # step 10, the first at >= 0.9, at 15 s
    assert result["step_0.9"] == 10
    assert result["last_10pct_reward"] == pytest.approx((0.95 + 0.5) / 2)  # the last 2 of 20 steps
    assert grid.result_of("baseline", 4, 0, {}, [], [], 1, 3.0)["exact"] is None  # a run that failed early


def result(setting, ps, seed, exact, to_09):
    return {
        "setting": setting,
        "sync_steps": ps,
        "seed": seed,
        "exact": exact,
        "last_10pct_reward": exact,
        "to_0.9_s": to_09,
        "step_0.9": None if to_09 is None else to_09 / 2,
    }


def test_the_table_counts_the_seeds_at_the_target_and_compares_times_with_the_baseline_at_4(grid):
    results = [
        result("baseline", 4, 0, 1.0, 10.0),
        result("baseline", 4, 1, 0.574, 14.0),
        result("baseline", 8, 0, 0.651, 8.0),
        result("kl_guard", 8, 0, 1.0, 18.0),
        result("kl_guard", 8, 1, 0.99, None),
        result("kl_guard", 8, 2, None, None),
    ]
    rows = {(r["setting"], r["sync_steps"]): r for r in grid.table_rows(results)}
    assert list(rows) == [("baseline", 4), ("baseline", 8), ("kl_guard", 8)]
    base4, guard8 = rows[("baseline", 4)], rows[("kl_guard", 8)]
    assert (base4["at_target"], base4["min_exact"], base4["median_to_0.9_s"]) == (1, 0.574, 12.0)
    assert base4["median_exact"] == pytest.approx(0.787)
    assert base4["to_0.9_ratio"] == 1.0 and rows[("baseline", 8)]["to_0.9_ratio"] == pytest.approx(8 / 12)
    assert (guard8["runs"], guard8["at_target"], guard8["min_exact"]) == (3, 2, 0.99)  # 0.99 counts; a failed run not
    assert guard8["median_to_0.9_s"] == 18.0 and guard8["to_0.9_ratio"] == 1.5 and guard8["median_step_0.9"] == 9.0
    assert "| kl_guard | 8 | 2 / 3 | 0.990 / 0.995 |" in grid.format_table(list(rows.values()))
    assert grid.table_rows([result("dr_grpo", 4, 0, 1.0, 9.0)])[0]["to_0.9_ratio"] is None  # no baseline at 4


def test_a_finished_run_is_not_run_again(grid, tmp_path, monkeypatch):
    done = grid.run_dir(tmp_path, "lr_schedule", 4, 7)
    done.mkdir(parents=True)
    (done / "result.json").write_text(json.dumps(result("lr_schedule", 4, 7, 1.0, 12.5)))

    def measure(*args, **kwargs):
        raise AssertionError("a finished run was run again")

    monkeypatch.setattr(grid.peer_bench(), "measure", measure)
    assert grid.run_one("lr_schedule", 4, 7, tmp_path, tmp_path / "python")["to_0.9_s"] == 12.5
    with pytest.raises(AssertionError, match="run again"):  # one without its result is run
        grid.run_one("lr_schedule", 4, 8, tmp_path, tmp_path / "python")
