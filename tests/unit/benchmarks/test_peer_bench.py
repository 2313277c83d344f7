"""benchmarks/peer_bench.py's pure parts: the moving-mean threshold crossing, the steady-state step time, the
process tree and its PSS sum, and the verdicts against issue 18's targets. (The bench itself needs .venv-trl
and minutes; `make bench-peers` runs it.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from bench_scripts import load_bench  # tests/bench_scripts.py (tests/conftest.py puts tests/ on sys.path)


@pytest.fixture(scope="module")
def bench():
    yield from load_bench("peer_bench")


def test_crossing_is_the_first_full_window_whose_mean_reaches_the_threshold(bench):
    rewards = [0.9, 0.9, 0.9, 0.9, 0.1, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
    steps = [(i + 1, r, 10.0 + i) for i, r in enumerate(rewards)]
    # windows: steps 1-5 mean 0.74, 2-6 0.66, 3-7 0.58, 4-8 0.54, 5-9 0.54, 6-10 0.70, 7-11 0.80
    assert bench.moving_mean_crossing(steps, 0.5) == 14.0  # step 5: a full window; steps 1-4 alone never count
    assert bench.moving_mean_crossing(steps, 0.7) == 14.0
    assert bench.moving_mean_crossing(steps, 0.75) == 20.0  # step 11: 7-11 mean 0.80 (6-10: 0.70 < 0.75)
    assert bench.moving_mean_crossing(steps, 0.81) is None
    assert bench.moving_mean_crossing(steps[:4], 0.1) is None  # fewer steps than a window
    assert bench.moving_mean_crossing(steps, 0.54, window=1) == 10.0


def test_crossing_counts_a_mean_equal_to_the_threshold(bench):
    steps = [(i + 1, 0.5, float(i)) for i in range(5)]
    assert bench.moving_mean_crossing(steps, 0.5) == 4.0


def test_steady_state_is_the_second_half_of_the_stamps(bench):
    steps = [(k, 0.0, 5.0 + (k if k <= 3 else 3 + 0.5 * (k - 3))) for k in range(1, 11)]  # 1 s/step, then 0.5
    assert bench.steady_state_s_per_step(steps) == pytest.approx(0.5)  # steps 6..10
    assert bench.steady_state_s_per_step(steps[:3]) is None


def test_descendants_walks_the_whole_tree_and_nothing_else(bench):
    parents = {1: 0, 10: 1, 11: 10, 12: 10, 13: 12, 20: 1, 21: 20}
    assert sorted(bench.descendants(10, parents)) == [10, 11, 12, 13]
    assert bench.descendants(13, parents) == [13]


def test_pss_kb_reads_the_pss_line(bench):
    text = "55d0-7ffd ---p 00000000 00:00 0  [rollup]\nRss:  2048 kB\nPss:  1536 kB\nPss_Anon:  1000 kB\n"
    assert bench.pss_kb(text) == 1536
    assert bench.pss_kb("Rss: 10 kB\n") == 0


def test_tree_pss_sums_a_real_process_tree(bench):
    """A child that holds 64 MB of its own and a grandchild: the tree's sum counts all three processes and exceeds
    the parent's own PSS by about the child's private memory."""
    code = (
        "import subprocess, sys, time; x = bytearray(64 << 20); x[::4096] = b'1' * len(x[::4096]); "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); print('up', flush=True); "
        "time.sleep(30)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        time.sleep(0.2)  # the grandchild's exec
        total_kb, procs = bench.tree_pss_kb(child.pid)
        assert {pid for pid, _, _ in procs} >= {child.pid} and len(procs) == 2
        assert sum(kb for _, _, kb in procs) == total_kb
        own = dict((pid, kb) for pid, _, kb in procs)[child.pid]
        assert own >= 64 * 1024  # the bytearray is the child's alone, so all of it is in its PSS
        mine_kb, mine = bench.tree_pss_kb(os.getpid())
        assert mine_kb > total_kb and len(mine) >= 3  # this process, the child and the grandchild
    finally:
        for pid in [pid for pid, _, _ in bench.tree_pss_kb(child.pid)[1]][::-1]:
            os.kill(pid, 9)
        child.wait()


def test_verdicts_judge_the_ratio_of_the_medians(bench):
    dppo = {"to_0.9_s": 8.0, "whole_s": 30.0, "pss_mb": 2100.0}
    trl = {"to_0.9_s": 10.0, "whole_s": 30.0, "pss_mb": 1000.0}
    judged = bench.verdicts(dppo, trl)
    assert judged["to_0.9_s"]["ratio"] == pytest.approx(0.8) and judged["to_0.9_s"]["pass"]  # at the limit: PASS
    assert judged["whole_s"]["pass"]
    assert judged["pss_mb"]["ratio"] == pytest.approx(2.1) and not judged["pss_mb"]["pass"]
    missing = bench.verdicts({**dppo, "to_0.9_s": None}, trl)  # dppo never reached 0.9
    assert missing["to_0.9_s"]["ratio"] is None and not missing["to_0.9_s"]["pass"]


def test_median_range_skips_missing_values(bench):
    assert bench.median_range([3.0, None, 1.0, 2.0]) == (2.0, 1.0, 3.0)
    assert bench.median_range([None]) == (None, None, None)


# ---- the text task (--task text, issue 18's point 3) ----------------------------------------------------


@pytest.fixture(scope="module")
def text_reward():
    yield from load_bench("text_peer_reward")


@pytest.mark.parametrize(("response", "score", "named"), [
    ("7" * 64, 1.0, 1.0),            # the named digit, 64 times
    ("3" * 64, 1.0, 0.0),            # one digit, not the named one: full score (named_digit logs the gap)
    ("7" * 32, 0.5, 0.5),            # stopped half way: each missing position costs 1/64
    ("73" * 32, 0.5, 0.5),           # two digits mixed: only the most frequent counts
    ("7" * 80, 1.0, 1.0),            # past 64 characters nothing counts
    ("ab c" * 16, 0.0, 0.0),         # no digits
    ("", 0.0, 0.0),
])  # fmt: skip
def test_the_text_reward_is_the_share_of_64_positions_holding_the_most_frequent_digit(
    text_reward, response, score, named
):
    out = text_reward.compute_score("repeat_digit", response, "7")
    assert out["score"] == pytest.approx(score) and out["named_digit"] == pytest.approx(named)


def test_a_dppo_text_run_reports_its_greedy_reward_under_its_data_source(bench):
    assert bench.eval_reward({"val/score/repeat_digit": 0.75}) == 0.75
    assert bench.eval_reward({"eval/reward": 0.5, "eval/accuracy": 1.0}) == 0.5  # TRL's scripts and the copy task
    assert bench.eval_reward({}) is None


def test_the_text_task_runs_dppo_on_vllm_with_the_matched_batch_and_lr(bench, tmp_path):
    keys = dict(k.split("=", 1) for k in bench.text_overrides(tmp_path, 5e-4))
    assert keys["rollout.name"] == "vllm" and keys["actor.lr"] == "0.0005"
    assert keys["trainer.train_batch_size"] == keys["rollout.groups_per_batch"] == str(bench.TEXT_PROMPTS)
    assert keys["data.max_response_length"] == "64" and keys["model.path"] == str(tmp_path / "model")
    assert keys["custom_reward_function.path"].endswith("benchmarks/text_peer_reward.py")


def test_the_text_task_prints_its_ratios_without_a_verdict_it_does_not_own(bench):
    figures = {"to_0.9_s": (100.0, 100.0, 100.0), "whole_s": (500.0, 500.0, 500.0)}
    summary = {"dppo": figures, "trl": {"to_0.9_s": (199.0, 199.0, 199.0), "whole_s": (100.0, 100.0, 100.0)}}
    summary["dppo"].update({key: (None, None, None) for key, *_ in bench.ROWS if key not in figures})
    summary["trl"].update({key: (None, None, None) for key, *_ in bench.ROWS if key not in summary["trl"]})
    judged = bench.verdicts({"to_0.9_s": 100.0}, {"to_0.9_s": 199.0}, bench.TEXT_TARGETS)
    table = bench.format_table(summary, judged)
    assert judged == {} and "PASS" not in table and "FAIL" not in table
    assert "0.50x" in table  # the ratio is printed all the same


def test_the_pss_sampler_takes_at_most_its_duty_of_a_core(bench):
    assert bench.sampler_wait(0.001) == bench.SAMPLE_S  # cheap samples: the plain period
    cost = 0.3  # a dozen processes of several GB
    wait = bench.sampler_wait(cost)
    assert cost / (cost + wait) <= bench.SAMPLER_DUTY and wait == pytest.approx(cost / bench.SAMPLER_DUTY)


# ---- issue 32: every run's final greedy figures; a run that ends below 0.99 exact match fails ------------------------


def test_a_run_that_ends_below_0_99_exact_match_fails_the_target_line_and_is_named(bench):
    """Seed 1 peaked and collapsed at its last step (exact match 0.574): fast to 0.9 and still a failure."""
    verdict = bench.final_exact_verdict([(0, 1.0), (1, 0.574), (2, 0.995)])
    assert not verdict["pass"] and verdict["failing"] == [(1, 0.574)]
    assert bench.format_final_verdict(verdict) == (
        "FAIL final exact match: every dppo run ends at greedy exact match >= 0.99; 1 of 3 did not: seed 1 at 0.574"
    )
    passing = bench.final_exact_verdict([(0, 1.0), (1, 0.99)])  # at the limit: PASS
    assert passing["pass"] and bench.format_final_verdict(passing).startswith("PASS final exact match")
    missing = bench.final_exact_verdict([(0, 1.0), (3, None)])  # no evaluation (a failed run): FAIL
    assert not missing["pass"] and "seed 3 at n/a" in bench.format_final_verdict(missing)
    assert not bench.final_exact_verdict([])["pass"]


def test_the_final_table_has_a_row_per_run_with_its_greedy_figures(bench):
    runs = [
        bench.Run(
            "trl",
            0,
            evaluation={"eval/reward": 1.0, "eval/accuracy": 1.0},
            steps=[(k, 0.95, 3.0 + k) for k in range(1, 6)],
        ),
        bench.Run("dppo", 1, evaluation={"eval/reward": 0.9041, "eval/accuracy": 0.574}),
        bench.Run("dppo", 0, evaluation={"eval/reward": 1.0, "eval/accuracy": 1.0}),
    ]
    rows = bench.final_table(runs).splitlines()[2:]
    assert rows == [
        "| dppo | 0 | 1.000 | 1.000 | n/a |",
        "| dppo | 1 | 0.574 | 0.904 | n/a |",
        "| trl | 0 | 1.000 | 1.000 | 8.0 |",
    ]
