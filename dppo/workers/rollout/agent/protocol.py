"""The OpenAI wire format of the agent endpoint: request bodies checked against the run's sampling, response bodies
with vLLM's token fields.

Sampling rule: a completion is always sampled with the run's SamplingSettings (greedy in a session the trainer opened
greedy, for evaluation), because the trainer's behaviour log-probs must be those of the distribution each token was
sampled from. A request that asks for anything else is an error, never overridden with a warning: an agent written
with temperature=0.7 would otherwise train on samples it believes are something they are not. So a 400 names the
field, the value asked and the run's value, for: temperature other than the run's (temperature 0 included: greedy
evaluation is the trainer's call, made per session), top_p, top_k, min_p, penalties, logit_bias, min_tokens,
best_of, beam search, ignore_eos, stop strings and stop token ids other than the run's, guided decoding and a
response_format other than text. n other than 1 is a 400 (an agent that wants n samples runs n times: dppo runs
rollout.n agents per prompt), stream=true is a 400 (no SSE), top_logprobs > 0 is a 400 (the engine returns the
sampled token's log-prob only). `seed` is ignored (logged once per endpoint): the worker seeds its own streams. Every
other unknown key is ignored; `model` is ignored. tool_choice "none" keeps the tools in the prompt (every turn's prompt
then renders them alike) and parses no tool calls; any other tool_choice (auto, required, a named function) parses
whatever the model wrote: the endpoint cannot force a call. max_tokens and max_completion_tokens are synonyms (both: a 400).
vLLM-style extra_body keys (return_token_ids, top_k...) arrive at the top level, as the openai client sends them.

Responses are OpenAI's plus vLLM's token fields, so that clients that record tokens themselves (verifiers' TITO and
MITO clients) work unchanged: top-level `prompt_token_ids`, `choices[].token_ids` (the sampled ids, the stop token
included), and, where logprobs were asked for, `choices[].logprobs.content[] = {token, logprob, bytes,
top_logprobs: []}` (one entry per sampled id, the stop token's included). /v1/completions also puts
`prompt_token_ids` in its choice, as vLLM does.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from dppo.workers.rollout.agent.chat import normalised_message
from dppo.workers.rollout.agent.errors import AgentRequestError, SamplingMismatchError
from dppo.workers.rollout.agent.generator import SamplingSettings

# keys that change the sampled distribution or its stopping, with the value that leaves it as the run samples
_NEUTRAL = {
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "length_penalty": 1.0,
    "min_tokens": 0,
    "best_of": 1,
    "use_beam_search": False,
    "ignore_eos": False,
    "echo": False,
}
_UNSUPPORTED = ("logit_bias", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


@dataclass
class ChatRequest:
    messages: list[dict]  # normalised (chat.normalised_message)
    tools: list[dict] | None
    parse_tools: bool  # tools given and tool_choice is not "none"
    max_tokens: int | None  # None: the run's default
    logprobs: bool


@dataclass
class TextRequest:
    prompt: str | list[int]
    max_tokens: int | None
    logprobs: bool


def _number(body: dict, key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AgentRequestError(f"{key}={value!r}: expected a number", key)
    return float(value)


def _mismatch(key: str, value: object, run_value: object, why: str) -> SamplingMismatchError:
    return SamplingMismatchError(
        f"{key}={value!r} asked, but this run samples with {key}={run_value!r} ({why}); the trainer's behaviour "
        f"log-probs must be those of the distribution sampled from: leave {key} out or send {run_value!r}",
        key,
    )


def check_sampling(body: dict, settings: SamplingSettings) -> None:
    """Raise an AgentRequestError where body asks for sampling other than the run's (see the module docstring)."""
    temperature = _number(body, "temperature")
    if temperature is not None and temperature != settings.temperature:
        why = "rollout.temperature; greedy evaluation is chosen by the trainer per session, not by the request"
        raise _mismatch("temperature", body["temperature"], settings.temperature, why)
    top_p = _number(body, "top_p")
    if top_p is not None and top_p != settings.top_p:
        raise _mismatch("top_p", body["top_p"], settings.top_p, "the full softmax")
    top_k = _number(body, "top_k")
    if top_k is not None and top_k != settings.top_k and not (top_k in (-1, 0) and settings.top_k in (-1, 0)):
        raise _mismatch("top_k", body["top_k"], settings.top_k, "no top-k")
    for key, neutral in _NEUTRAL.items():
        if body.get(key) is not None and body[key] != neutral:
            raise _mismatch(key, body[key], neutral, f"no {key}")
    for key in _UNSUPPORTED:
        if body.get(key) not in (None, {}, []):
            raise SamplingMismatchError(f"{key} is not supported: the run samples without it", key)
    stop = body.get("stop")
    if stop not in (None, "", []):
        raise SamplingMismatchError(
            f"stop={stop!r}: stop strings are not supported; a completion ends at the run's stop tokens "
            f"{list(settings.stop_token_ids)} (the chat template's end of turn) or at max_tokens",
            "stop",
        )
    stop_ids = body.get("stop_token_ids")
    ids_ok = isinstance(stop_ids, list) and all(isinstance(t, int) for t in stop_ids)
    if stop_ids not in (None, []) and (not ids_ok or set(stop_ids) != set(settings.stop_token_ids)):
        raise _mismatch("stop_token_ids", stop_ids, list(settings.stop_token_ids), "the run's stop tokens")
    response_format = body.get("response_format")
    if response_format is not None and (not isinstance(response_format, dict) or response_format.get("type") != "text"):
        raise SamplingMismatchError(
            f"response_format={response_format!r}: only type 'text' is supported", "response_format"
        )


def _check_shape(body: dict) -> None:
    """n, stream and top_logprobs: what the endpoint does not answer."""
    if body.get("n") is not None and body["n"] != 1:
        raise AgentRequestError(
            f"n={body['n']!r}: one completion per request (an agent that wants several runs several times; dppo runs "
            "rollout.n agents per prompt)",
            "n",
        )
    if body.get("stream"):
        raise AgentRequestError("stream=true: the endpoint answers whole completions only; leave stream out", "stream")
    top = body.get("top_logprobs")
    if top not in (None, 0):
        raise AgentRequestError(
            f"top_logprobs={top!r}: the engine returns the sampled token's log-prob only; leave it out or send 0",
            "top_logprobs",
        )


def _max_tokens(body: dict) -> int | None:
    given = [k for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None]
    if len(given) == 2:
        raise AgentRequestError(
            "max_tokens and max_completion_tokens both given: they mean the same; send one", "max_completion_tokens"
        )
    if not given:
        return None
    value = body[given[0]]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise AgentRequestError(f"{given[0]}={value!r}: expected an int > 0", given[0])
    return value


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools in (None, []):
        return None
    ok = isinstance(tools, list) and all(
        isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
        for t in tools
    )
    if not ok:
        raise AgentRequestError("tools: expected a list of {'type': 'function', 'function': {'name', ...}}", "tools")
    return [{"type": "function", "function": t["function"]} for t in tools]


def parse_chat(body: dict, settings: SamplingSettings) -> ChatRequest:
    """A /v1/chat/completions body, checked (AgentRequestError)."""
    _check_shape(body)
    check_sampling(body, settings)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise AgentRequestError("messages: expected a non-empty list", "messages")
    messages = [normalised_message(m, i) for i, m in enumerate(messages)]
    if messages[-1]["role"] == "assistant":
        raise AgentRequestError(
            "the last message is an assistant message: continuing one is not supported (end with the message the "
            "model answers)",
            "messages",
        )
    tools = _tools(body)
    return ChatRequest(
        messages,
        tools,
        tools is not None and body.get("tool_choice") != "none",
        _max_tokens(body),
        bool(body.get("logprobs")),
    )


def parse_text(body: dict, settings: SamplingSettings) -> TextRequest:
    """A /v1/completions body, checked: prompt a string or a list of token ids (one prompt)."""
    _check_shape(body)
    check_sampling(body, settings)
    prompt = body.get("prompt")
    token_ids = (
        isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    )
    if not (isinstance(prompt, str) and prompt) and not token_ids:
        raise AgentRequestError(
            "prompt: expected a non-empty string or a non-empty list of token ids (one prompt per request)", "prompt"
        )
    logprobs = body.get("logprobs")
    if logprobs not in (None, 0, 1, True, False):
        raise AgentRequestError(
            f"logprobs={logprobs!r}: the engine returns the sampled token's log-prob only; send 0 or 1", "logprobs"
        )
    return TextRequest(prompt, _max_tokens(body), logprobs is not None and logprobs is not False)


def _head(kind: str, model: str) -> dict:
    prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model}


def _usage(prompt_ids: list[int], token_ids: list[int]) -> dict:
    n, m = len(prompt_ids), len(token_ids)
    return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


def chat_response(
    model: str,
    prompt_ids: list[int],
    token_ids: list[int],
    message: dict,
    finish_reason: str,
    logprobs: list[dict] | None,
) -> dict:
    """A chat.completion body. message: the assistant message (role, content, tool_calls where there are);
    logprobs: chat_logprobs(...) where asked for."""
    choice = {
        "index": 0,
        "message": message,
        "finish_reason": finish_reason,
        "logprobs": None if logprobs is None else {"content": logprobs},
        "token_ids": list(token_ids),
    }
    return {
        **_head("chat.completion", model),
        "choices": [choice],
        "usage": _usage(prompt_ids, token_ids),
        "prompt_token_ids": list(prompt_ids),
    }


def chat_logprobs(tokens: list[str], logprobs: list[float]) -> list[dict]:
    """logprobs.content of a chat choice: tokens are the sampled ids' texts."""
    return [
        {"token": t, "logprob": float(lp), "bytes": list(t.encode("utf-8")), "top_logprobs": []}
        for t, lp in zip(tokens, logprobs)
    ]


def text_response(
    model: str, prompt_ids: list[int], token_ids: list[int], text: str, finish_reason: str, logprobs: dict | None
) -> dict:
    """A text_completion body; logprobs: text_logprobs(...) where asked for."""
    choice = {
        "index": 0,
        "text": text,
        "finish_reason": finish_reason,
        "logprobs": logprobs,
        "token_ids": list(token_ids),
        "prompt_token_ids": list(prompt_ids),
    }
    return {
        **_head("text_completion", model),
        "choices": [choice],
        "usage": _usage(prompt_ids, token_ids),
        "prompt_token_ids": list(prompt_ids),
    }


def text_logprobs(tokens: list[str], logprobs: list[float]) -> dict:
    """The legacy completions logprobs object (tokens, token_logprobs, text offsets; no alternatives)."""
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [float(x) for x in logprobs],
        "top_logprobs": None,
        "text_offset": offsets,
    }


def models_response(model: str) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "dppo"}]}


def error_body(error: AgentRequestError) -> dict:
    kind = "invalid_request_error" if error.status < 500 else "server_error"
    return {"error": {"message": str(error), "type": kind, "param": error.param, "code": error.code}}
