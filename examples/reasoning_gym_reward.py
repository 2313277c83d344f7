"""The reward of `dppo data reasoning-gym` parquet rows: each dataset's own verifier (score_answer) on the answer
dppo.data.reasoning_gym.extract_answer takes from the response, as data.source=reasoning_gym scores.

    dppo data reasoning-gym basic_arithmetic train.parquet --size 2000
    dppo data reasoning-gym basic_arithmetic val.parquet --size 100 --seed 2000 --split val
    dppo train model.path=... data.train_files=train.parquet data.val_files=val.parquet \\
        custom_reward_function.path=examples/reasoning_gym_reward.py

The rows' extra_info names the dataset and its config (as JSON) and holds the entry score_answer reads.
"""

import json

from dppo.data.reasoning_gym import ReasoningGymScore

_scorers: dict[tuple[str, str], ReasoningGymScore] = {}  # one per dataset and config, built on first use


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    key = (extra_info["dataset"], extra_info["config"])
    if key not in _scorers:
        _scorers[key] = ReasoningGymScore(key[0], json.loads(key[1]))
    return _scorers[key](data_source, solution_str, ground_truth, extra_info)
