"""Conversation -> token ids, with the tokenizer's own chat template; the model's sampled tokens are never re-encoded.

A session's first chat request (or one that continues no earlier completion) is rendered whole:
apply_chat_template(messages, tools=..., add_generation_prompt=True), then encoded. A later request that continues
a recorded completion (its parent: see ledger.Session.chat_parent) gets

    prompt_ids = parent.prompt_ids + parent.completion_ids (+ the end-of-turn token, masked, if the parent was cut
                 by length) + bridge

where the bridge is the template's tokens for the new messages: everything after the parent's end-of-turn token up
to and including the next generation prompt. For SmolLM2 and a tool reply that is
"\\n<|im_start|>tool\\n56088<|im_end|>\\n<|im_start|>assistant\\n": the "\\n" the template writes after <|im_end|> is part of it.

How the bridge is found: AReaL's alignment on the k-th end-of-turn token. The whole new conversation is rendered
(each recorded assistant message as the exact text of its sampled tokens), encoded, and cut after its k-th
end-of-turn token, k being the number of end-of-turn tokens in the parent's sequence; the tail is the bridge. Chosen
over verifiers' double render of a dummy assistant message followed by the new messages because it renders only
conversations the agent itself sent: templates that refuse a conversation starting with an assistant message (those
that check roles alternate), that render a message according to the ones before it (Qwen's grouping of consecutive
tool replies, templates that put the tools into the first system message), or that add a default system prompt to a
partial render all give the right tail, and the same render checks the head: the cut head, decoded, must equal the
parent's tokens decoded. Where it does not (the template renders history otherwise than the model saw it, a model
that wrote the text of a special token), the request is rendered anew (ledger.Session counts it in
agent/retokenize_mismatch). Qwen3-style templates that drop earlier turns' reasoning always do so: known, not
supported.

Messages are compared normalised (normalised_message): content None equals "" (a list of text parts is joined),
keys other than role, content, tool_calls, tool_call_id and name are dropped (reasoning_content, refusal,
annotations...), a tool call is {type, function: {name, arguments}} without its id, and its arguments are compared
as parsed JSON. Tools: see dppo.workers.rollout.agent.tools.
"""

from __future__ import annotations

import json

from dppo.workers.rollout.agent.errors import AgentRequestError, StitchError
from dppo.workers.rollout.agent.tools import tool_call_text, with_tool_block

_KEPT = ("tool_call_id", "name")
_SYSTEM_SENTINEL = "dppo-system-sentinel"
_USER_SENTINEL = "dppo-user-sentinel"


def _content_text(content: object, where: str) -> str:
    """A message's content as text: None -> "", a list of text parts joined; anything else is refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise AgentRequestError(f"{where}.content: expected a string, null or a list of text parts", "messages")


def _arguments(arguments: object) -> object:
    """A tool call's arguments in comparable form: the parsed JSON where the string parses, else the string."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def _normalised_call(call: object, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise AgentRequestError(
            f"{where}: expected {{'type': 'function', 'function': {{'name', 'arguments'}}}}", "messages"
        )
    return {
        "type": "function",
        "function": {"name": function["name"], "arguments": _arguments(function.get("arguments", {}))},
    }


def normalised_message(message: object, index: int = 0) -> dict:
    """The message in the form the ledger compares and renders (see the module docstring)."""
    where = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise AgentRequestError(f"{where}: expected an object with a string 'role'", "messages")
    out = {"role": message["role"], "content": _content_text(message.get("content"), where)}
    calls = message.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise AgentRequestError(f"{where}.tool_calls: expected a list", "messages")
        out["tool_calls"] = [_normalised_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls)]
    for key in _KEPT:
        if message.get(key) is not None:
            out[key] = str(message[key])
    return out


def _first_difference(a: str, b: str) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"at character {i}: rendered {a[max(0, i - 20) : i + 20]!r}, tokens {b[max(0, i - 20) : i + 20]!r}"


class ChatFormat:
    """A tokenizer's chat template as the ledger uses it. tokenizer: a transformers tokenizer with a chat template.
    end_token_id: the template's end-of-turn token (SamplingSettings.end_token_id)."""

    def __init__(self, tokenizer, end_token_id: int):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{type(tokenizer).__name__} has no chat_template: the agent endpoint renders with it")
        self.tokenizer, self.end_token_id = tokenizer, int(end_token_id)
        self._renders_tools: bool | None = None  # found with the first request that has tools
        self._default_system: str | None = self._find_default_system()

    def encode(self, text: str) -> list[int]:
        """Token ids of text as a chat template's output is encoded (its special tokens' text as those tokens, no
        BOS added: a template that wants one writes it)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        """The exact text of ids, special tokens included."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _template(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False
            )
        except Exception as error:  # jinja2's TemplateError and the template's own raise_exception
            raise AgentRequestError(
                f"the chat template cannot render these messages: {type(error).__name__}: {error}", "messages"
            ) from error

    def _find_default_system(self) -> str | None:
        """The system prompt the template adds to a conversation without one (SmolLM2: "You are a helpful AI
        assistant named SmolLM, ..."), or None where it adds none."""
        user = {"role": "user", "content": _USER_SENTINEL}
        try:
            with_system = self._template([{"role": "system", "content": _SYSTEM_SENTINEL}, user], None, False)
            alone = self._template([user], None, False)
        except AgentRequestError:  # a template that takes no system message, say: then it adds none either
            return None
        pre, found, post = with_system.partition(_SYSTEM_SENTINEL)
        if found and alone.startswith(pre) and alone.endswith(post) and len(alone) >= len(pre) + len(post):
            return alone[len(pre) : len(alone) - len(post)]
        return None

    def renders_tools(self, tools: list[dict]) -> bool:
        """Whether the template writes `tools` into the prompt itself (it renders differently with them)."""
        if self._renders_tools is None:
            user = [{"role": "user", "content": _USER_SENTINEL}]
            self._renders_tools = self._template(user, tools, True) != self._template(user, None, True)
        return self._renders_tools

    def _renderable(self, message: dict, template_tools: bool) -> dict:
        """A normalised message as the template gets it: where the template cannot render tool calls (it ignores
        tools), an assistant message's tool calls become Hermes text after its content."""
        if "tool_calls" not in message or template_tools:
            return message
        calls = [tool_call_text(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
        content = "\n".join(([message["content"]] if message["content"] else []) + calls)
        return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": content}

    def render(self, messages: list[dict], tools: list[dict] | None) -> str:
        """The prompt text of normalised messages with the generation prompt; tools go through the template where it
        renders them, into the system message as a Hermes block where it ignores them."""
        template_tools = bool(tools) and self.renders_tools(tools)
        messages = [self._renderable(m, template_tools) for m in messages]
        if tools and not template_tools:
            messages = with_tool_block(messages, tools, self._default_system)
        return self._template(messages, tools if template_tools else None, True)

    def bridge(self, parent_ids: list[int], messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The template's tokens after the parent's sequence parent_ids (ending in an end-of-turn token) up to the
        generation prompt, for the whole new conversation messages (recorded assistant messages as their sampled
        text). Raises StitchError where the render does not continue parent_ids (see the module docstring)."""
        full = self.encode(self.render(messages, tools))
        k = parent_ids.count(self.end_token_id)
        ends = [i for i, t in enumerate(full) if t == self.end_token_id]
        if k == 0 or len(ends) < k:
            raise StitchError(
                f"the tokens so far hold {k} end-of-turn tokens ({self.end_token_id}) and the rendered conversation "
                f"{len(ends)}: the render cannot be aligned on them"
            )
        cut = ends[k - 1] + 1
        rendered, sampled = self.decode(full[:cut]), self.decode(parent_ids)
        if rendered != sampled:
            raise StitchError(
                f"the template renders the conversation so far otherwise than its tokens decode: "
                f"{_first_difference(rendered, sampled)}"
            )
        if cut == len(full):
            raise StitchError("the template renders nothing after the conversation so far")
        return full[cut:]
