"""Reward function of the text example (examples/text_reverse.py), in verl's signature.

dppo runs it on the rollout workers: custom_reward_function.path=examples/text_reverse_reward.py
"""


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: the fewest insertions, deletions and substitutions that turn a into b."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Partial credit: 1 - edit distance / the longer length, so each right character in the right order counts
    and each extra one costs. The other keys are logged as reward/extra/<key> means."""
    response = solution_str.strip()
    longer = max(len(response), len(ground_truth))
    return {
        "score": 1.0 - edit_distance(response, ground_truth) / longer if longer else 1.0,
        "exact_match": float(response == ground_truth),
        "response_chars": float(len(response)),
    }
