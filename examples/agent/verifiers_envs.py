"""Two environments of the verifiers library (its classic API, the extra dppo[envs]) trained through dppo's agent
endpoint on reasoning-gym's products of two 3-digit numbers: `make bench-envs` (benchmarks/env_library.py) runs each
for 3 steps with examples/agent/verifiers_envs.yaml.

    rollout.agent.name=multi_turn_agent   CalcTagEnv, a MultiTurnEnv: the model writes <calc>EXPRESSION</calc>, the
                                          environment answers with a user message <result>VALUE</result>; a turn
                                          without a call is the answer and ends the rollout
    rollout.agent.name=tool_agent         a ToolEnv with the tool calculator(expression): OpenAI function calling, the
                                          endpoint showing SmolLM2 the tool as a Hermes block in the system message and
                                          parsing the <tool_call> blocks it writes; a turn without a call ends it

Each is wrapped as a dppo agent by dppo.envs.verifiers_env.verifiers_agent: nothing else is written for dppo. Both
show the model two solved problems first (few_shot), as examples/agent/calculator_agent.py does (with SmolLM2-135M
one demonstration gave 19% tool use, two 87%). The reward (the rubric's correct_answer) is 1 where the last turn
holds no call and its last number is the product (the row's ground truth), else 0; calculator_calls (logged as
agent/calculator_calls) counts the calculator's uses, num_turns (agent/num_turns) the model's turns.

dppo's rows (data.source=reasoning_gym, dataset products) are what the agents run on. verifiers wants a dataset for
an environment too: each gets 32 problems of the same kind (what verifiers' own evaluation would read; dppo does not).
The calculator is dppo.tools.calculator, a parser of arithmetic (no eval), run in the agent's process.
"""

from __future__ import annotations

from dppo.data.reasoning_gym import generate
from dppo.data.rewards import last_number
from dppo.envs.verifiers_env import classic_verifiers, verifiers_agent
from dppo.tools.calculator import CalculatorError, calculate, find_calls

vf = classic_verifiers("examples/agent/verifiers_envs.py")

PRODUCTS = {"min_terms": 2, "max_terms": 2, "min_digits": 3, "max_digits": 3}
MAX_TURNS = 3  # two calculator calls, then the answer
QUESTION = "Solve the following multiplication: {} * {}. Give only the result as your final answer."

CALC_SYSTEM = "Reply <calc>EXPRESSION</calc> to use the calculator; it answers <result>VALUE</result>. Then reply with the number only."
CALC_EXAMPLE = [
    {"role": "user", "content": QUESTION.format(123, 456)},
    {"role": "assistant", "content": "<calc>123 * 456</calc>"},
    {"role": "user", "content": "<result>56088</result>"},
    {"role": "assistant", "content": "56088"},
    {"role": "user", "content": QUESTION.format(907, 315)},
    {"role": "assistant", "content": "<calc>907 * 315</calc>"},
    {"role": "user", "content": "<result>285705</result>"},
    {"role": "assistant", "content": "285705"},
]

TOOL_SYSTEM = "Call the calculator tool to compute. Then reply with the number only."


def _call(call_id: str, expression: str) -> dict:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "calculator", "arguments": {"expression": expression}},
    }


TOOL_EXAMPLE = [
    {"role": "user", "content": QUESTION.format(123, 456)},
    {"role": "assistant", "content": None, "tool_calls": [_call("call_1", "123 * 456")]},
    {"role": "tool", "tool_call_id": "call_1", "content": "56088"},
    {"role": "assistant", "content": "56088"},
    {"role": "user", "content": QUESTION.format(907, 315)},
    {"role": "assistant", "content": None, "tool_calls": [_call("call_2", "907 * 315")]},
    {"role": "tool", "tool_call_id": "call_2", "content": "285705"},
    {"role": "assistant", "content": "285705"},
]


def calculator(expression: str) -> str:
    """Compute an arithmetic expression.

    Args:
        expression: The arithmetic to compute, such as "123 * 456".

    Returns:
        The value, or the error that the expression gave.
    """
    try:
        return calculate(expression)
    except CalculatorError as err:
        return f"error: {err}"


def _role(message) -> str | None:
    return message.get("role") if isinstance(message, dict) else getattr(message, "role", None)


def _text(message) -> str:
    """A message's text (verifiers hands messages as its pydantic models, dicts where a user wrote them)."""
    content = message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
    return content if isinstance(content, str) else ""


def correct_answer(completion, answer) -> float:
    """1.0 where the last assistant turn calls nothing and its last number is the answer."""
    turns = [m for m in completion if _role(m) == "assistant"]
    text = _text(turns[-1]) if turns else ""
    if find_calls(text) or "<tool_call>" in text:
        return 0.0
    number = last_number(text)
    return float(number is not None and number.replace(",", "") == answer.strip())


def calculator_calls(completion) -> float:
    """How many <calc> calls the environment answered (ToolEnv counts its own calls under the same name)."""
    return float(sum(_text(m).startswith("<result>") for m in completion if _role(m) == "user"))


def products_dataset(size: int = 32, seed: int = 9000):
    """The environment's own dataset (verifiers requires one): reasoning-gym's 3-digit products, built offline."""
    from datasets import Dataset  # verifiers' dependency

    entries = generate("products", PRODUCTS, size, seed)
    return Dataset.from_list([{"question": e["question"], "answer": e["answer"]} for e in entries])


class CalcTagEnv(vf.MultiTurnEnv):
    """The model calls the calculator as <calc>EXPRESSION</calc>; the reply is a user message <result>VALUE</result>
    (or the calculator's error); a turn without a call is the answer."""

    async def env_response(self, messages, state, **kwargs):
        expression = find_calls(_text(messages[-1]))[0]  # answered() stopped every turn without a call
        return [vf.UserMessage(content=f"<result>{calculator(expression)}</result>")]

    @vf.stop
    async def answered(self, state) -> bool:
        trajectory = state["trajectory"]
        return bool(trajectory) and not find_calls(_text(trajectory[-1]["completion"][-1]))


def calc_tag_env():
    return CalcTagEnv(
        dataset=products_dataset(),
        system_prompt=CALC_SYSTEM,
        few_shot=CALC_EXAMPLE,
        rubric=vf.Rubric(funcs=[correct_answer, calculator_calls], weights=[1.0, 0.0]),
        max_turns=MAX_TURNS,
    )


def calculator_tool_env():
    return vf.ToolEnv(
        tools=[calculator],
        dataset=products_dataset(),
        system_prompt=TOOL_SYSTEM,
        few_shot=TOOL_EXAMPLE,
        rubric=vf.Rubric(funcs=[correct_answer]),
        max_turns=MAX_TURNS,
    )


# max_tokens per turn: a <calc> call or an answer is a few tokens (SmolLM2 writes digits one token each), a
# <tool_call> block about 25
multi_turn_agent = verifiers_agent(calc_tag_env, sampling_args={"max_tokens": 24})
tool_agent = verifiers_agent(calculator_tool_env, sampling_args={"max_tokens": 48})
