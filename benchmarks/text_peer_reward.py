"""Reward of the text task of benchmarks/text_peer_task.py, in verl's signature (dppo and TRL call the same one).

The prompt "repeat 7" asks for one digit written RESPONSE_TOKENS times. The score is the share of the
RESPONSE_TOKENS positions that hold the response's most frequent digit, so a response that stops early, mixes
digits or strays loses credit for each position it misses (generation is capped at RESPONSE_TOKENS tokens, one
token per digit). The prompt's own digit is logged as `named_digit` (the share holding it) but not scored: a
43M model from random weights did not learn to copy it within this benchmark's budget (RESULTS.md).
"""

from collections import Counter

RESPONSE_TOKENS = 64


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """score: the share of the first RESPONSE_TOKENS characters that are the response's most frequent digit."""
    response = solution_str.strip()[:RESPONSE_TOKENS]
    counts = Counter(c for c in response if c.isdigit())
    top = max(counts.values()) if counts else 0
    return {
        "score": top / RESPONSE_TOKENS,
        "named_digit": response.count(ground_truth) / RESPONSE_TOKENS,
        "response_chars": float(len(response)),
    }
