"""AgentRollout: an agent function run n times per row through the worker's endpoint over a real engine (the hf
engine on the tiny SmolLM2-architecture model), its runs made into groups. The turns' ids are the engine's own
samples (their behaviour log-probs a teacher-forced forward of the engine's weights), the mask is exact token by token,
a weight change between two turns shows in the second turn's versions, and an agent that raises, hangs or returns
no reward gets 0 and a counted error while the others go on."""

from __future__ import annotations

import asyncio
import textwrap

import pytest
import torch

from dppo.batch import collate
from dppo.data.errors import AgentFunctionError
from dppo.data.rewards import RewardRow
from dppo.data.user_code import FileFunction
from dppo.models import response_log_probs
from dppo.workers.rollout.agent.generator import SamplingSettings
from dppo.workers.rollout.agent.ledger import AgentLimits
from dppo.workers.rollout.agent.runner import AgentRollout, RolloutEngineError, agent_groups
from dppo.workers.rollout.engines.hf import HFEngine

EOS, TEMPERATURE = 2, 1.0

AGENTS = """
import asyncio

async def two_turns(client, row):
    messages = list(row["prompt"])
    first = await client.chat.completions.create(model="m", messages=messages, max_tokens=5)
    messages.append({"role": "assistant", "content": first.choices[0].message.content})
    messages.append({"role": "tool", "content": "42"})  # a fake tool's output, masked out of the loss
    if row["extra_info"].get("publish_between_turns"):
        row["extra_info"]["publish_between_turns"]()
    second = await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
    return {"score": float(len(second.choices[0].message.content or "") % 2), "tool_calls": 1}

async def flaky(client, row):
    kind = row["extra_info"]["kind"]
    await client.chat.completions.create(model="m", messages=row["prompt"], max_tokens=3)
    if kind == "raise":
        raise ValueError("the tool fell over")
    if kind == "hang":
        await asyncio.sleep(60)
    if kind == "none":
        return None
    return 1.0
"""


@pytest.fixture(scope="module")
def model_dir(tiny_smollm):
    return tiny_smollm["model"]


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture
def engine(model_dir):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir))
    eng = HFEngine(model.config, "float32", TEMPERATURE, 8, EOS, EOS, micro_batch_size=4, partial_chunk=2)
    eng.load_weights(model.state_dict())
    eng.seed(0)
    return eng


def _rollout(tmp_path, name, engine, tokenizer, timeout_s=30.0, max_turns=4) -> AgentRollout:
    path = tmp_path / "agents.py"
    path.write_text(textwrap.dedent(AGENTS))
    fn = FileFunction(str(path), name, "rollout.agent", AgentFunctionError)
    settings = SamplingSettings(TEMPERATURE, (EOS,), 8)
    return AgentRollout(fn, engine, tokenizer, settings, AgentLimits(max_turns, 64), 8, timeout_s)


def _row(i: int, **extra) -> RewardRow:
    return RewardRow("calc", str(i), dict(extra), f"row {i}", ({"role": "user", "content": f"what is {i} + {i}?"},))


def test_a_two_turn_agent_trains_on_the_engines_own_tokens_with_the_tools_masked(tmp_path, engine, tokenizer):
    rollout = _rollout(tmp_path, "two_turns", engine, tokenizer)
    try:
        runs = rollout.run([_row(1), _row(2)], 3, version=5)
    finally:
        rollout.close()
    assert len(runs) == 6 and all(r.error is None for r in runs)
    tool_turn = "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"  # the template's, between the turns
    for run in runs:
        t = run.trajectory
        assert t.turns == 2 and t.retokenize_mismatch == 0
        first = t.loss_mask.index(0)  # turn 1's sampled ids, then the bridge, then turn 2's
        second = first + t.loss_mask[first:].index(1)
        assert t.loss_mask == [1] * first + [0] * (second - first) + [1] * (len(t.loss_mask) - second)
        bridge = tokenizer.decode(t.response_ids[first:second])  # a turn cut by length gets its end token (masked)
        ended = t.response_ids[first - 1] == EOS
        assert bridge == ("" if ended else "<|im_end|>") + tool_turn, bridge
        ids = torch.tensor([t.prompt_ids + t.response_ids])
        with torch.no_grad():
            want = response_log_probs(engine.model, ids, len(t.response_ids), TEMPERATURE, 1)[0]
        sampled = torch.tensor(t.loss_mask, dtype=torch.bool)
        torch.testing.assert_close(torch.tensor(t.behav_logp)[sampled], want[sampled], rtol=0, atol=1e-4)
        assert t.versions == [5] * len(t.versions)
        assert run.stats()["agent/turns_mean"] == 2.0 and run.extras == {"agent/tool_calls": 1.0}
    groups = agent_groups(runs, 3, [[1, 2], [3, 4]], 5, EOS)
    assert len(groups) == 2
    for g, group_runs in zip(groups, (runs[:3], runs[3:])):
        assert group_runs[0].trajectory.prompt_ids == group_runs[1].trajectory.prompt_ids == g.prompt.tolist()
        for i, run in enumerate(group_runs):
            k = len(run.trajectory.response_ids)
            assert g.responses[i, :k].tolist() == run.trajectory.response_ids
            assert g.response_mask[i, :k].tolist() == [bool(m) for m in run.trajectory.loss_mask]
            assert not g.response_mask[i, k:].any()
        assert g.scores.tolist() == [r.reward for r in group_runs] and g.version == 5
        assert g.reward_extra["agent/errors"].tolist() == [0.0, 0.0, 0.0]
    batch = collate(groups, EOS)
    assert batch.response_mask.sum() == sum(sum(r.trajectory.loss_mask) for r in runs)


def test_a_weight_change_between_two_turns_shows_in_the_second_turns_versions(tmp_path, engine, tokenizer):
    new_weights = {k: v + 0.01 * torch.randn_like(v) for k, v in engine.model.state_dict().items()}
    published = {}

    def publish():  # the trainer publishes version 6 while the agent's tool runs
        published[6] = new_weights

    def refresh():
        if not published:
            return None
        version, weights = published.popitem()

        def load() -> int:
            engine.load_weights(weights)
            return version

        return load

    rollout = _rollout(tmp_path, "two_turns", engine, tokenizer)
    try:
        (run,) = rollout.run([_row(1, publish_between_turns=publish)], 1, version=5, refresh=refresh)
    finally:
        rollout.close()
    t = run.trajectory
    first = t.loss_mask.index(0)
    second = first + t.loss_mask[first:].index(1)
    assert t.versions[:first] == [5] * first  # turn 1 and the bridge after it: version 5
    assert t.versions[second:] == [6] * (len(t.versions) - second)  # turn 2: the weights published meanwhile
    (group,) = agent_groups([run], 1, [[1]], 5, EOS)
    batch = collate([group], EOS)
    assert batch.behav_versions()[0, second : len(t.versions)].tolist() == [6] * (len(t.versions) - second)
    assert group.version == 5  # staleness counts the oldest token


def test_an_agent_that_raises_hangs_or_returns_no_reward_gets_zero_and_the_others_go_on(tmp_path, engine, tokenizer):
    rollout = _rollout(tmp_path, "flaky", engine, tokenizer, timeout_s=2.0)
    kinds = ["ok", "raise", "hang", "none"]
    try:
        runs = rollout.run([_row(i, kind=k) for i, k in enumerate(kinds)], 1, version=0)
    finally:
        rollout.close()
    assert [r.reward for r in runs] == [1.0, 0.0, 0.0, 0.0]
    assert runs[0].error is None
    assert runs[1].error == "raised ValueError: the tool fell over"
    assert runs[2].error == "took longer than rollout.agent.timeout_s=2"
    assert runs[3].error.startswith("returned NoneType None")
    assert all(r.trajectory.turns == 1 for r in runs)  # what each sampled is kept
    groups = agent_groups(runs, 1, [[1]] * 4, 0, EOS)
    assert [g.reward_extra["agent/errors"].item() for g in groups] == [0.0, 1.0, 1.0, 1.0]


def test_an_engine_failure_fails_the_ticket_not_the_agents(tmp_path, engine, tokenizer):
    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    engine.complete = broken
    rollout = _rollout(tmp_path, "two_turns", engine, tokenizer)
    try:
        with pytest.raises(RolloutEngineError, match="out of memory"):
            rollout.run([_row(1)], 2, version=0)
    finally:
        rollout.close()
    assert not asyncio.iscoroutinefunction(rollout.close)
