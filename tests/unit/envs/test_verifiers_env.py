"""dppo.envs.verifiers_env: verifiers' environments (examples/agent/verifiers_envs.py's MultiTurnEnv and ToolEnv) as
dppo agents, their rollouts through the agent endpoint over a scripted engine (SmolLM2's tokenizer and chat template:
the tiny GGUF of tests/tiny_gguf.py). Each turn's prompt is the previous one's ids, the sampled ids and the template's
bridge (the calculator's result as a user or tool message), the reward is the rubric's, dppo's limits end a rollout as
truncated, a request the endpoint refuses fails the run loudly, and building an environment leaves the process's
signal handlers alone (in any thread).

verifiers is the extra dppo[envs], which `make test` does not install: these tests are skipped there and run in
.venv-envs (`make test-envs`; tests/README.md)."""

from __future__ import annotations

import asyncio
import importlib.util
import signal
import threading
from pathlib import Path

import pytest

vf = pytest.importorskip("verifiers")

from dppo.envs import verifiers_env
from dppo.envs.verifiers_env import (
    VerifiersEnvError,
    VerifiersRolloutError,
    rollout_input,
    verifiers_agent,
)
from dppo.workers.rollout.agent.endpoint import AgentEndpoint
from dppo.workers.rollout.agent.errors import TokenBudgetError, TurnLimitError
from dppo.workers.rollout.agent.generator import Completion, SamplingSettings
from dppo.workers.rollout.agent.ledger import AgentLimits

REPO = Path(__file__).resolve().parents[3]
EOS = 2  # <|im_end|>
QUESTION = "Solve the following multiplication: 361 * 220. Give only the result as your final answer."
ROW = {
    "prompt": [{"role": "user", "content": QUESTION}],
    "ground_truth": "79420",
    "data_source": "products",
    "extra_info": {"question": QUESTION, "answer": "79420", "metadata": {"expression": "361 * 220"}},
}
TOOL_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "361 * 220"}}\n</tool_call>'


@pytest.fixture(scope="module")
def example():
    """examples/agent/verifiers_envs.py as a module (its two agents built once)."""
    spec = importlib.util.spec_from_file_location("example_verifiers_envs", REPO / "examples/agent/verifiers_envs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tokenizer(tiny_smollm):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(tiny_smollm["model"]))


class ScriptedGenerator:
    """The engine: its script's completions in order; keeps every request."""

    def __init__(self, script: list[Completion]):
        self.script, self.requests = list(script), []

    async def generate(self, request):
        self.requests.append(request)
        return self.script.pop(0)


@pytest.fixture
def run(tokenizer):
    """run(agent, texts, max_turns=8, temperature=1.0) -> (what the agent returned, the session's Trajectory, the
    engine's requests, the completions): the agent on ROW through an endpoint whose engine samples texts in order
    (each encoded, then EOS)."""

    def go(agent, texts, max_turns=8, temperature=1.0):
        completions = []
        for text in texts:
            ids = tokenizer.encode(text, add_special_tokens=False) + [EOS]
            completions.append(Completion(ids, [-0.5] * len(ids), [1] * len(ids), "stop"))
        generator = ScriptedGenerator(completions)
        settings = SamplingSettings(temperature=temperature, stop_token_ids=(EOS,), max_tokens=256)
        endpoint = AgentEndpoint(generator, tokenizer, settings, AgentLimits(max_turns, 4096, max_prompt_tokens=4096))

        async def main():
            await endpoint.start()
            try:
                session = endpoint.new_session()
                client = endpoint.client(session)
                try:
                    result = await agent(client, ROW)
                finally:
                    await client.close()
                return result, endpoint.close_session(session)
            finally:
                await endpoint.stop()

        result, trajectory = asyncio.run(main())
        return result, trajectory, generator.requests, completions

    return go


def decode(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _long(agent):
    """The agent with room for a whole <tool_call> block per turn (the tiny tokenizer spends a token per character
    or two: the example's 48 tokens hold SmolLM2's, not its)."""
    return verifiers_agent(agent.env, sampling_args={"max_tokens": 256})


def test_the_multi_turn_env_calls_the_calculator_and_answers_in_one_stitched_sequence(example, run, tokenizer):
    result, trajectory, requests, (call, answer) = run(example.multi_turn_agent, ["<calc>361 * 220</calc>", "79420"])
    assert result == {
        "score": 1.0,
        "correct_answer": 1.0,
        "calculator_calls": 1.0,
        "num_turns": 2.0,
        "is_truncated": 0.0,
        "invalid_response": 0.0,
    }
    first, second = (list(r.prompt_ids) for r in requests)
    # the first prompt: the environment's system prompt and its two solved examples, then the row's question
    text = decode(tokenizer, first)
    assert text.startswith(f"<|im_start|>system\n{example.CALC_SYSTEM}<|im_end|>\n")
    assert text.count("<|im_start|>user\n") == 5 and text.endswith(f"{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    # the second: the first prompt, the sampled ids as they were, and the bridge with the calculator's result
    bridge = second[len(first) + len(call.token_ids) :]
    assert second[: len(first) + len(call.token_ids)] == first + call.token_ids
    assert decode(tokenizer, bridge) == "\n<|im_start|>user\n<result>79420</result><|im_end|>\n<|im_start|>assistant\n"
    assert [r.max_tokens for r in requests] == [24, 24]  # the example's sampling_args
    assert trajectory.prompt_ids == first
    assert trajectory.response_ids == call.token_ids + bridge + answer.token_ids
    assert trajectory.loss_mask == [1] * len(call.token_ids) + [0] * len(bridge) + [1] * len(answer.token_ids)
    assert (trajectory.turns, trajectory.retokenize_mismatch, trajectory.tool_parse_failures) == (2, 0, 0)


def test_the_tool_env_gets_openai_tool_calls_and_its_tool_reply_is_the_bridge(example, run, tokenizer):
    result, trajectory, requests, (call, answer) = run(_long(example.tool_agent), [TOOL_CALL, "79420"])
    assert result == {
        "score": 1.0,
        "correct_answer": 1.0,
        "num_turns": 2.0,
        "total_tool_calls": 1.0,
        "calculator_calls": 1.0,
        "is_truncated": 0.0,
        "invalid_response": 0.0,
    }
    first, second = (list(r.prompt_ids) for r in requests)
    text = decode(tokenizer, first)
    # SmolLM2's template ignores `tools`: the endpoint wrote them into the system message, and the examples' tool
    # calls as the <tool_call> blocks the model is to write
    assert '<tools>\n{"type": "function", "function": {"name": "calculator"' in text
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123 * 456"}}\n</tool_call>' in text
    assert "<|im_start|>tool\n56088<|im_end|>" in text
    bridge = second[len(first) + len(call.token_ids) :]
    assert second[: len(first) + len(call.token_ids)] == first + call.token_ids
    assert decode(tokenizer, bridge) == "\n<|im_start|>tool\n79420<|im_end|>\n<|im_start|>assistant\n"
    assert trajectory.response_ids == call.token_ids + bridge + answer.token_ids
    assert (trajectory.turns, trajectory.retokenize_mismatch, trajectory.tool_parse_failures) == (2, 0, 0)


@pytest.mark.parametrize("agent_name", ["multi_turn_agent", "tool_agent"])
def test_a_wrong_answer_scores_0_and_an_answer_without_a_call_ends_the_rollout(example, run, agent_name):
    result, trajectory, requests, _ = run(_long(getattr(example, agent_name)), ["79421"])
    assert (result["score"], result["correct_answer"], result["num_turns"]) == (0.0, 0.0, 1.0)
    assert (len(requests), trajectory.turns) == (1, 1)


def test_a_malformed_tool_call_is_counted_and_reaches_the_env_as_text(example, run):
    bad = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "361 * 220"}\n</tool_call>'  # a brace short
    result, trajectory, _, _ = run(_long(example.tool_agent), [bad])
    assert trajectory.tool_parse_failures == 1
    assert (result["score"], result["total_tool_calls"], result["num_turns"]) == (0.0, 0.0, 1.0)  # no call: it ends


def test_dppo_s_turn_limit_ends_the_rollout_as_truncated_not_as_an_error(example, run):
    result, trajectory, requests, _ = run(example.multi_turn_agent, ["<calc>361 * 220</calc>", "79420"], max_turns=1)
    assert len(requests) == 1 and trajectory.turns == 1
    assert (result["score"], result["is_truncated"], result["invalid_response"]) == (0.0, 1.0, 0.0)


def test_the_limit_codes_are_the_endpoint_s():
    assert verifiers_env.LIMIT_CODES == {TurnLimitError.code, TokenBudgetError.code}


def test_a_temperature_the_run_does_not_sample_with_fails_the_run_naming_it(example, run):
    agent = verifiers_agent(example.multi_turn_agent.env, sampling_args={"temperature": 0.7})
    with pytest.raises(VerifiersRolloutError, match=r"temperature=0\.7 asked, but this run samples with temperature"):
        run(agent, ["79420"])


def test_an_empty_response_is_the_policy_s_and_scores_0(example, run):
    result, trajectory, _, _ = run(example.multi_turn_agent, [""])
    assert (result["score"], result["invalid_response"], trajectory.turns) == (0.0, 1.0, 1)


def test_the_row_becomes_verifiers_rollout_input(example):
    env = example.multi_turn_agent.env
    got = rollout_input(env, ROW)
    assert got["prompt"] == [
        {"role": "system", "content": example.CALC_SYSTEM},
        *example.CALC_EXAMPLE,
        ROW["prompt"][0],
    ]
    assert (got["answer"], got["info"]) == ("79420", ROW["extra_info"])
    assert got["example_id"] == rollout_input(env, dict(ROW, ground_truth="1"))["example_id"]  # by the messages
    own = dict(ROW, prompt=[{"role": "system", "content": "Be brief."}, *ROW["prompt"]], ground_truth=79420)
    got = rollout_input(env, own)
    assert got["prompt"] == [{"role": "system", "content": "Be brief."}, *example.CALC_EXAMPLE, ROW["prompt"][0]]
    assert (got["answer"], rollout_input(env, dict(ROW, extra_info=None))["info"]) == ("79420", {})


def _handlers():
    return {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}


def test_building_an_env_leaves_the_signal_handlers_alone(example):
    before = _handlers()
    agent = verifiers_agent(example.calc_tag_env)
    assert isinstance(agent.env, example.CalcTagEnv)
    assert _handlers() == before
    errors = []

    def build():  # where a local rollout worker loads an agent file: its agents' thread
        try:
            verifiers_agent(example.calculator_tool_env)
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    thread = threading.Thread(target=build)
    thread.start()
    thread.join()
    assert errors == [] and _handlers() == before


def test_an_env_that_scores_groups_is_refused(example):
    async def best_of_group(states) -> list[float]:
        return [1.0] * len(states)

    def make():
        return example.CalcTagEnv(dataset=example.products_dataset(4), rubric=vf.Rubric(funcs=[best_of_group]))

    with pytest.raises(VerifiersEnvError, match="scores groups of rollouts together"):
        verifiers_agent(make)
    with pytest.raises(VerifiersEnvError, match="expected a verifiers Environment, got dict"):
        verifiers_agent(dict)


FAKE_ENV_PACKAGE = """
import verifiers as vf
from datasets import Dataset


def exact(completion, answer) -> float:
    return float(completion[-1].content.strip() == answer)


def load_environment(system_prompt="Answer."):
    dataset = Dataset.from_list([{"question": "6 * 7", "answer": "42"}])
    return vf.SingleTurnEnv(dataset=dataset, system_prompt=system_prompt, rubric=vf.Rubric(funcs=[exact]))
"""


def test_an_installed_environment_runs_by_its_id_with_its_arguments(tmp_path, monkeypatch, run, tokenizer):
    (tmp_path / "dppo_fake_env.py").write_text(FAKE_ENV_PACKAGE)  # what `vf-install dppo-fake-env` puts on the path
    monkeypatch.syspath_prepend(str(tmp_path))
    before = _handlers()
    agent = verifiers_agent("dppo-fake-env", system_prompt="Reply with the number.")
    assert _handlers() == before
    assert isinstance(agent.env, vf.SingleTurnEnv) and agent.env.env_id == "dppo-fake-env"
    result, trajectory, requests, _ = run(agent, ["79420"])
    assert (result["score"], result["exact"], trajectory.turns) == (1.0, 1.0, 1)
    assert decode(tokenizer, requests[0].prompt_ids).startswith("<|im_start|>system\nReply with the number.<|im_end|>")
    with pytest.raises(VerifiersEnvError, match=r"environment arguments \['size'\] are for an environment id"):
        verifiers_agent(agent.env, size=3)
