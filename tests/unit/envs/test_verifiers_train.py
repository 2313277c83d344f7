"""`dppo train` with a verifiers environment as the agent (dppo.envs.verifiers_env), on reasoning-gym problems and the
tiny SmolLM2-architecture model, in separate_async mode: the local rollout worker loads the agent file (and builds the
environment) in its agents' thread, every rollout makes the environment's two turns, verifiers' own count of them
equals the ledger's, and the rubric's reward and metrics reach metrics.jsonl, the evaluation's included.

verifiers is the extra dppo[envs]: skipped in `make test`, run by `make test-envs` (tests/README.md)."""

from __future__ import annotations

import json
import textwrap

import pytest
from tiny_run import reasoning_gym_overrides  # tests/tiny_run.py (tests/conftest.py puts tests/ on sys.path)

pytest.importorskip("verifiers")

from dppo.cli import main

# a MultiTurnEnv that always answers once (max_turns=2: two completions per rollout whatever the random model
# writes), its reward the parity of the last turn's length, so that a group's rewards differ
AGENT = """
import verifiers as vf
from datasets import Dataset

from dppo.envs.verifiers_env import verifiers_agent


class OneReply(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(content="<result>12</result>")]


def odd_length(completion) -> float:
    return float(len(completion[-1].content or "") % 2)


def make():
    dataset = Dataset.from_list([{"question": "1 + 1", "answer": "2"}])
    return OneReply(dataset=dataset, rubric=vf.Rubric(funcs=[odd_length]), max_turns=2)


agent = verifiers_agent(make, sampling_args={"max_tokens": 4})
"""


def test_a_verifiers_env_trains_through_a_local_rollout_worker(tmp_path, tiny_smollm):
    path = tmp_path / "agent.py"
    path.write_text(textwrap.dedent(AGENT))
    overrides = reasoning_gym_overrides(
        tmp_path,
        tiny_smollm["model"],
        **{
            "trainer.mode": "separate_async",
            "rollout.agent.path": path,
            "rollout.agent.max_prompt_length": 128,
            "data.max_response_length": 40,
        },
    )
    assert main(["train", *overrides]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["agent/errors"] == 0.0  # the worker built the env in its agents' thread
        assert 1.0 < r["agent/turns_mean"] <= 2.0
        # the ledger's completions are verifiers' turns, and the one response verifiers refuses where a rollout
        # ends on it (the random model's end token first: empty); means over the same runs
        assert r["agent/turns_mean"] == r["agent/num_turns"] + r["agent/invalid_response"]
        assert r["agent/retokenize_mismatch"] == 0.0
        assert 0.0 < r["agent/masked_token_frac"] < 1.0  # the environment's reply between the turns
        assert r["critic/score/mean"] == r["agent/odd_length"]  # the rubric's reward is the run's
    final = records[-1]
    val = {key: final[f"val/agent/{key}/basic_arithmetic"] for key in ("turns_mean", "num_turns", "invalid_response")}
    assert val["turns_mean"] == val["num_turns"] + val["invalid_response"] and val["turns_mean"] > 1.0
    assert 0.0 <= final["val/score/basic_arithmetic"] <= 1.0
