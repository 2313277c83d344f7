"""Tools for chat templates that know nothing of them, in the Hermes format (Qwen2.5's, NousResearch's).

Prompt side: when a request carries OpenAI `tools` and the tokenizer's chat template ignores them (SmolLM2's renders
the same text with and without), hermes_block's text is appended to the system message (a system message is added
where there is none, holding the template's own default system prompt first, so a template such as SmolLM2's, which
puts a default system prompt before a first message that is not "system", still shows the model that prompt).

Completion side: parse_tool_calls finds `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in the
completion's text and returns OpenAI `tool_calls` (ids `call_<hex>`, arguments as a JSON string) and the text with the
parsed blocks removed. A block whose JSON does not parse, or has no "name", stays in the text and is counted as a
parse failure (agent/tool_parse_failures): the agent sees what the model wrote.
"""

from __future__ import annotations

import json
import re
import secrets

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

_BLOCK_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_BLOCK_TAIL = (
    "</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)


def hermes_block(tools: list[dict]) -> str:
    """The system-prompt text that describes tools (OpenAI tool specs) to a Hermes-trained model."""
    lines = [json.dumps(tool, ensure_ascii=False) for tool in tools]
    return "\n".join([_BLOCK_HEAD, *lines, _BLOCK_TAIL])


def with_tool_block(messages: list[dict], tools: list[dict], default_system: str | None) -> list[dict]:
    """messages with hermes_block(tools) appended to the system message; one is put first where there is none,
    holding default_system (the template's own default system prompt, None: it has none) before the block."""
    block = hermes_block(tools)
    if messages and messages[0]["role"] == "system":
        content = messages[0]["content"]
        return [{**messages[0], "content": f"{content}\n\n{block}" if content else block}, *messages[1:]]
    content = f"{default_system}\n\n{block}" if default_system else block
    return [{"role": "system", "content": content}, *messages]


def tool_call_text(name: str, arguments: object) -> str:
    """One tool call as a Hermes block (how an assistant message's tool_calls are rendered for a template that
    cannot: only on the fallback path that renders a conversation anew)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def _parsed_call(body: str) -> dict | None:
    """An OpenAI tool call from one block's JSON, or None where it is not {"name": str, "arguments": ...}."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if not isinstance(arguments, str):  # a model may write the arguments as a JSON string already
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": call["name"], "arguments": arguments},
    }


def parse_tool_calls(text: str) -> tuple[str, list[dict], int]:
    """(text without the parsed blocks, stripped; the OpenAI tool calls in order; the blocks that did not parse)."""
    calls, failures, kept, start = [], 0, [], 0
    for match in TOOL_CALL.finditer(text):
        call = _parsed_call(match.group(1))
        if call is None:
            failures += 1
            continue
        calls.append(call)
        kept.append(text[start : match.start()])
        start = match.end()
    kept.append(text[start:])
    return "".join(kept).strip() if calls else text, calls, failures
