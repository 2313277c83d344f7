"""benchmarks/real_coverage.py's pure parts: the unbiased pass@k, the kind of a two-term problem, and the figures by
kind. (The measurement itself samples 64 answers to 256 problems on the real model: minutes, not a test.)"""

from __future__ import annotations

from itertools import combinations

import pytest
from bench_scripts import load_bench  # tests/bench_scripts.py (tests/conftest.py puts tests/ on sys.path)


@pytest.fixture(scope="module")
def bench():
    yield from load_bench("real_coverage")


@pytest.mark.parametrize("n,c,k", [(5, 2, 1), (5, 2, 2), (6, 1, 3), (6, 3, 4), (4, 0, 2)])
def test_pass_at_k_is_the_share_of_k_subsets_that_hold_a_right_sample(bench, n, c, k):
    # samples 0..c-1 are right: count the k-subsets of the n samples with at least one of them
    subsets = list(combinations(range(n), k))
    expected = sum(any(i < c for i in s) for s in subsets) / len(subsets)
    assert bench.pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_one_when_every_k_subset_must_hold_a_right_sample_and_rejects_bad_counts(bench):
    assert bench.pass_at_k(8, 5, 4) == 1.0  # only 3 wrong samples: any 4 hold a right one
    assert bench.pass_at_k(8, 0, 8) == 0.0
    with pytest.raises(ValueError, match="n=4, c=5, k=1"):
        bench.pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match="k=9"):
        bench.pass_at_k(8, 1, 9)


@pytest.mark.parametrize(
    "question,expected",
    [
        ("What is 27 + 15? Answer with just the number.", "add, carry"),
        ("Calculate 21 + 34.", "add, no carry"),
        ("Calculate 5 + 5 =", "add, carry"),
        ("What is 52 - 17?", "sub, borrow"),
        ("What is 17 - 52?", "sub, borrow, negative"),
        ("What is 58 - 12?", "sub, no borrow"),
        ("What is 3 - 20?", "sub, borrow, negative"),  # the magnitude, 20 - 3, borrows
        ("What is 3 - 24?", "sub, no borrow, negative"),
        ("What is 7 - 7?", "sub, no borrow"),
    ],
)
def test_the_kind_of_a_problem_is_read_from_its_terms(bench, question, expected):
    assert bench.kind(question) == expected


def test_a_question_without_two_terms_is_refused_by_name(bench):
    with pytest.raises(ValueError, match="What is seven"):
        bench.kind("What is seven?")


def test_the_summary_is_over_all_problems_and_by_kind(bench):
    questions = ["1 + 2", "3 + 4", "50 - 7", "7 - 13"]
    right = [4, 0, 2, 0]  # of n=4 samples
    greedy = [True, False, True, False]
    result = bench.summarize(questions, right, greedy, n=4)
    whole = result["all"]
    assert whole["problems"] == 4 and whole["greedy"] == 0.5
    assert set(whole) == {"problems", "greedy", "pass@1", "pass@4", "never_right"}  # no k above n
    assert whole["pass@1"] == pytest.approx((1.0 + 0.0 + 0.5 + 0.0) / 4)
    assert whole["pass@4"] == pytest.approx(0.5) and whole["never_right"] == 0.5
    by_kind = result["by_kind"]
    assert list(by_kind) == ["add, no carry", "sub, borrow", "sub, borrow, negative"]
    assert by_kind["add, no carry"]["problems"] == 2 and by_kind["add, no carry"]["pass@1"] == pytest.approx(0.5)
    assert by_kind["sub, borrow, negative"]["never_right"] == 1.0
    lines = bench.table(result).splitlines()
    assert lines[0].startswith("| problems | n | greedy | pass@1 | pass@4 | never_right |")
    assert lines[2] == "| all | 4 | 0.500 | 0.375 | 0.500 | 0.500 |"
    assert len(lines) == 2 + 1 + 3
