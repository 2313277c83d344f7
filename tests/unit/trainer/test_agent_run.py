"""`dppo train` with rollout.agent: a two-turn agent with a fake tool on reasoning-gym problems and the tiny
SmolLM2-architecture model, in sync mode in the trainer's process and in separate_async with a local worker process:
the agent's numbers reach the metrics, a failing agent counts its errors and the run goes on, and the evaluation runs
the agent greedily on the held-out problems."""

from __future__ import annotations

import json
import textwrap

import pytest
from tiny_run import reasoning_gym_overrides  # tests/tiny_run.py (tests/conftest.py puts tests/ on sys.path)

from dppo.cli import main

AGENT = """
async def agent(client, row):
    messages = list(row["prompt"])
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    messages.append({"role": "assistant", "content": first.choices[0].message.content})
    if row["ground_truth"].endswith("7"):  # one problem in ten: the agent's own code fails
        raise RuntimeError("the calculator is down")
    messages.append({"role": "tool", "content": "12"})
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=3)
    answer = second.choices[0].message.content or ""
    return {"score": float(answer.strip() == row["ground_truth"]), "used_tool": 1.0}
"""


@pytest.fixture
def agent_run(tmp_path, tiny_smollm):
    path = tmp_path / "agent.py"
    path.write_text(textwrap.dedent(AGENT))

    def run(**extra) -> list[dict]:
        overrides = reasoning_gym_overrides(
            tmp_path,
            tiny_smollm["model"],
            **{
                "rollout.agent.path": path,
                "rollout.agent.max_prompt_length": 128,
                "data.max_response_length": 40,
                **extra,
            },
        )
        assert main(["train", *overrides]) == 0
        lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    return run


@pytest.mark.parametrize("mode", ["sync", "separate_async"])
def test_an_agent_trains_and_is_evaluated_through_its_endpoint(agent_run, mode):
    records = agent_run(**{"trainer.mode": mode})
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert 1.0 <= r["agent/turns_mean"] <= 2.0  # a failed run made one completion, the others two
        assert 0.0 < r["agent/masked_token_frac"] < 1.0  # the tool's message and the template between the turns
        assert r["agent/used_tool"] == 1.0 and r["agent/errors"] >= 0.0 and r["agent/env_time_s"] >= 0.0
        assert r["agent/retokenize_mismatch"] == 0.0
        assert r["response_length/mean"] > 0.0
    assert sum(r["agent/errors"] for r in records) > 0, "the test needs an agent run that failed"
    final = records[-1]
    assert 0.0 <= final["val/score/basic_arithmetic"] <= 1.0
    assert final["val/agent/used_tool/basic_arithmetic"] <= 1.0
    assert "val/agent/turns_mean/basic_arithmetic" in final
