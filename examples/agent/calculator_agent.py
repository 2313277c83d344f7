"""A tool-using agent for `make agent`: SmolLM2-135M-Instruct answers 3-digit multiplications with a calculator.

It is written as a user of dppo writes an agent: an async function of an OpenAI client and a data row that returns
the reward (rollout.agent.path=examples/agent/calculator_agent.py, rollout.agent.name=agent). The conversation:

    system     how to call the calculator: <calc>EXPRESSION</calc>, and that its answer comes back as <result>...</result>
    user       one solved example (the demonstration turn): "Solve the following multiplication: 123 * 456. ..."
    assistant  <calc>123 * 456</calc>
    user       <result>56088</result>
    assistant  56088
    user       the row's question (reasoning-gym's `products`: "Solve the following multiplication: 361 * 220. ...")

About 150 tokens before the model's first turn. Measured on the base model (vLLM, bf16, 2026-12-04): with this one
demonstration it called the calculator in 19% of its runs at temperature 1 and answered 9% right (64 held-out
problems, 4 samples each), greedy 0.20; with a second demonstration (907 * 315) 87% and 51%, and greedy 1.000 on the
256 held-out problems: the prompt alone would do the task, so make agent keeps one and leaves the rest to the
training. With the two questions shortened to "123 * 456 = ?", 10% and 2% (it matches the example's wording).

then the model's turns: where one holds a <calc> call, the calculator's result (or its error) comes back as the next
user message, `<result>...</result>`, and the model answers again; at most MAX_CALLS calls. The reward is 1 when the
last number of the last turn equals the answer, else 0; `used_tool` (logged as agent/used_tool, and in the evaluation
as val/agent/used_tool/<data_source>) says whether the run called the calculator.

The calculator (dppo.tools.calculator) is a parser of arithmetic, not eval: it runs in the agent's process (its
docstring says why that is safe); a tool that executes what the model wrote (Python) would go through
dppo.tools.sandbox instead.
"""

from __future__ import annotations

import asyncio

from dppo.data.rewards import last_number
from dppo.tools.calculator import CalculatorError, calculate, find_calls

SYSTEM = "Reply <calc>EXPRESSION</calc> to use the calculator; it answers <result>VALUE</result>. Then reply with the number only."
EXAMPLE = [
    {
        "role": "user",
        "content": "Solve the following multiplication: 123 * 456. Give only the result as your final answer.",
    },
    {"role": "assistant", "content": "<calc>123 * 456</calc>"},
    {"role": "user", "content": "<result>56088</result>"},
    {"role": "assistant", "content": "56088"},
]
MAX_CALLS = 2  # calculator calls per run; the turn after the last one must answer
# seconds each call waits before it answers: 0 here; benchmarks/agent_latency.py sets it to simulate a remote tool
TOOL_LATENCY_S = 0.0
MAX_TOKENS = 24  # per turn: a call or an answer is a few tokens; digits are one token each in SmolLM2's vocabulary


def calculator(expression: str) -> str:
    """The tool: the value of expression, or the error the model gets to read."""
    try:
        return calculate(expression)
    except CalculatorError as err:
        return f"error: {err}"


async def agent(client, row) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, *EXAMPLE, *row["prompt"]]
    calls = 0
    text = ""
    for _ in range(MAX_CALLS + 1):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=MAX_TOKENS)
        text = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        expressions = find_calls(text)
        if not expressions or calls == MAX_CALLS:
            break
        calls += 1
        if TOOL_LATENCY_S:
            await asyncio.sleep(TOOL_LATENCY_S)
        messages.append({"role": "user", "content": f"<result>{calculator(expressions[0])}</result>"})
    answer = last_number(text) if not find_calls(text) else None
    right = answer is not None and answer.replace(",", "") == str(row["ground_truth"]).strip()
    return {"score": float(right), "used_tool": float(calls > 0)}
