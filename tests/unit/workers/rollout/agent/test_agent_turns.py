"""Agents through the real openai client: one token sequence per run, made of the engine's ids exactly (never
re-encoded) and the chat template's bridges, with the mask, log-probs and versions token by token."""

from __future__ import annotations

import json
import logging

from dppo.workers.rollout.agent.tools import hermes_block, parse_tool_calls

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]
EOS = 2  # <|im_end|>
SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def turn(role: str, content: str) -> str:
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


def bridge_text(role: str, content: str) -> str:
    """What ChatML puts between the sampled <|im_end|> and the next generation: the "\\n" after it, the message,
    the generation prompt (written out here, independently of the endpoint's rendering)."""
    return "\n" + turn(role, content) + "<|im_start|>assistant\n"


def expected_sequence(completions, bridges):
    """(response ids, mask, log-probs, versions) of completions with bridges between them, built token by token:
    mask 1 and the engine's values on sampled ids; mask 0, log-prob 0 and the previous sampled id's version on a
    bridge."""
    ids, mask, logp, versions = [], [], [], []
    for i, c in enumerate(completions):
        for t, lp, v in zip(c.token_ids, c.logprobs, c.versions):
            ids.append(t), mask.append(1), logp.append(lp), versions.append(v)
        if i < len(bridges):
            for t in bridges[i]:
                ids.append(t), mask.append(0), logp.append(0.0), versions.append(c.versions[-1])
    return ids, mask, logp, versions


def test_three_turns_with_a_tool_are_one_sequence_of_the_sampled_ids_and_masked_tool_replies(
    endpoint_of, sampled, encode, tokenizer, run_agent
):
    first = sampled('<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 7}}\n</tool_call>', 3)
    n = len(first.token_ids)
    # a weight update in the middle of the second turn: its first 5 tokens by version 3, the rest (and EOS) by 4
    text = 'Check: <tool_call>{"name": "add", "arguments": {"a": 19, "b": 0}}</tool_call>'
    second = sampled(text, [3] * 5 + [4] * (len(encode(text)) - 4))
    third = sampled("The answer is 19.", 5)
    endpoint, generator = endpoint_of([first, second, third])

    async def agent(client):
        messages, replies = [{"role": "user", "content": "What is 12 + 7?"}], []
        for i in range(3):
            reply = await client.chat.completions.create(
                model="policy",
                messages=messages,
                tools=TOOLS,
                temperature=1.0,
                logprobs=True,
                max_completion_tokens=200,
                extra_body={"return_token_ids": True},
            )
            replies.append(reply)
            message = reply.choices[0].message
            if not message.tool_calls:
                break
            if i == 0:  # as the openai package gives it back: content None, refusal/annotations/audio None
                messages.append(message.model_dump())
            else:  # as verifiers sends it back
                calls = [
                    {"type": "function", "id": c.id, "function": c.function.model_dump()} for c in message.tool_calls
                ]
                sent = {"role": "assistant", "content": message.content, "tool_calls": calls, "reasoning_content": None}
                messages.append(sent)
            for call in message.tool_calls:
                args = json.loads(call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
        return replies

    replies, trajectory = run_agent(endpoint, agent)

    # the first prompt: SmolLM2's default system prompt kept, the tools after it, then the user's message
    prompt = encode(
        turn("system", f"{SMOLLM_SYSTEM}\n\n{hermes_block(TOOLS)}")
        + turn("user", "What is 12 + 7?")
        + "<|im_start|>assistant\n"
    )
    bridges = [encode(bridge_text("tool", "19")), encode(bridge_text("tool", "19"))]
    assert bridges[0][0] == tokenizer.encode("\n", add_special_tokens=False)[0]  # the "\n" after <|im_end|>
    assert [list(r.prompt_ids) for r in generator.requests] == [
        prompt,
        prompt + first.token_ids + bridges[0],
        prompt + first.token_ids + bridges[0] + second.token_ids + bridges[1],
    ]
    assert [r.max_tokens for r in generator.requests] == [200, 200, 200]

    ids, mask, logp, versions = expected_sequence([first, second, third], bridges)
    assert trajectory.prompt_ids == prompt
    assert trajectory.response_ids == ids
    assert trajectory.loss_mask == mask
    assert trajectory.behav_logp == logp
    assert trajectory.versions == versions
    assert trajectory.versions[n : n + len(bridges[0])] == [3] * len(bridges[0])
    assert trajectory.versions[-len(third.token_ids) - 1] == 4  # the bridge after the update: its version
    assert trajectory.start_version == 3
    assert (trajectory.turns, trajectory.branches, trajectory.retokenize_mismatch) == (3, 0, 0)
    assert trajectory.masked_token_frac == (len(bridges[0]) + len(bridges[1])) / len(ids)
    assert trajectory.finish_reason == "stop"

    # what the agent saw: OpenAI tool calls, and vLLM's token fields equal to the engine's
    for reply, completion, request in zip(replies, [first, second, third], generator.requests):
        assert reply.prompt_token_ids == list(request.prompt_ids)
        assert reply.choices[0].token_ids == completion.token_ids
        assert [c.logprob for c in reply.choices[0].logprobs.content] == completion.logprobs
    one, two, three = (r.choices[0] for r in replies)
    assert (one.finish_reason, one.message.content) == ("tool_calls", None)
    assert one.message.tool_calls[0].id.startswith("call_")
    assert (one.message.tool_calls[0].function.name, json.loads(one.message.tool_calls[0].function.arguments)) == (
        "add",
        {"a": 12, "b": 7},
    )
    assert (two.finish_reason, two.message.content) == ("tool_calls", "Check:")
    assert (three.finish_reason, three.message.content, three.message.tool_calls) == ("stop", "The answer is 19.", None)


def test_sampled_ids_that_would_re_encode_otherwise_stay_as_sampled(endpoint_of, sampled, encode, tokenizer, run_agent):
    drift = [tokenizer.convert_tokens_to_ids("Ġ")] + encode("the") + encode(" sum is 19")  # " the sum is 19"
    assert encode(tokenizer.decode(drift)) != drift  # " the" re-encodes as one token
    first, second = sampled(drift, 1), sampled("ok", 2)
    endpoint, generator = endpoint_of([first, second])

    async def agent(client):
        messages = [{"role": "user", "content": "Sum?"}]
        reply = await client.chat.completions.create(model="policy", messages=messages)
        text = reply.choices[0].message.content
        messages += [{"role": "assistant", "content": text, "tool_calls": None}, {"role": "user", "content": "More?"}]
        await client.chat.completions.create(model="policy", messages=messages)
        return text

    text, trajectory = run_agent(endpoint, agent)
    assert text == " the sum is 19"
    bridge = encode(bridge_text("user", "More?"))
    prompt = list(generator.requests[0].prompt_ids)
    assert list(generator.requests[1].prompt_ids) == prompt + first.token_ids + bridge
    ids, mask, _, _ = expected_sequence([first, second], [bridge])
    assert (trajectory.response_ids, trajectory.loss_mask) == (ids, mask)
    assert trajectory.response_ids[: len(drift)] == drift
    assert (trajectory.retokenize_mismatch, trajectory.turns) == (0, 2)


def test_a_turn_cut_by_length_is_closed_by_a_masked_end_token(endpoint_of, sampled, encode, run_agent):
    first, second = sampled("The answer is", 1, stop=False), sampled(" 19.", 1)
    endpoint, generator = endpoint_of([first, second])

    async def agent(client):
        messages = [{"role": "user", "content": "Add 12 and 7."}]
        reply = await client.chat.completions.create(model="policy", messages=messages)
        messages += [reply.choices[0].message.model_dump(), {"role": "user", "content": "Go on."}]
        await client.chat.completions.create(model="policy", messages=messages)
        return reply.choices[0].finish_reason

    finish, trajectory = run_agent(endpoint, agent)
    assert finish == "length"
    bridge = [EOS] + encode(bridge_text("user", "Go on."))
    prompt = list(generator.requests[0].prompt_ids)
    assert list(generator.requests[1].prompt_ids) == prompt + first.token_ids + bridge
    ids, mask, logp, _ = expected_sequence([first, second], [bridge])
    assert (trajectory.response_ids, trajectory.loss_mask, trajectory.behav_logp) == (ids, mask, logp)
    assert trajectory.loss_mask[len(first.token_ids)] == 0  # the appended end token is not trained on


def test_an_agent_that_edits_its_history_is_rendered_anew_and_counted(endpoint_of, sampled, encode, run_agent, caplog):
    script = [sampled("Nineteen.", 1), sampled("19", 2), sampled("Yes.", 2), sampled("No.", 3)]
    endpoint, generator = endpoint_of(script)

    async def agent(client):
        user = [{"role": "user", "content": "12 + 7?"}]
        await client.chat.completions.create(model="policy", messages=user)
        edited = user + [{"role": "assistant", "content": "Twenty."}, {"role": "user", "content": "Digits?"}]
        reply = await client.chat.completions.create(model="policy", messages=edited)  # re-rendered: mismatch 1
        kept = edited + [reply.choices[0].message.model_dump(), {"role": "user", "content": "Sure?"}]
        await client.chat.completions.create(model="policy", messages=kept)  # continues the re-rendered turn
        edited[1]["content"] = "Eighteen."
        await client.chat.completions.create(model="policy", messages=edited)  # mismatch 2, not logged again

    with caplog.at_level(logging.WARNING, logger="dppo.rollout.agent"):
        _, trajectory = run_agent(endpoint, agent)
    anew = encode(
        turn("system", SMOLLM_SYSTEM)
        + turn("user", "12 + 7?")
        + turn("assistant", "Twenty.")
        + turn("user", "Digits?")
        + "<|im_start|>assistant\n"
    )
    assert list(generator.requests[1].prompt_ids) == anew
    assert trajectory.retokenize_mismatch == 2
    warnings = [r for r in caplog.records if "retokenize_mismatch" in r.getMessage()]
    assert len(warnings) == 1 and "edited history" in warnings[0].getMessage()
    # the main chain: the re-rendered turn and its continuation; the first and the last turn are branches
    bridge = encode(bridge_text("user", "Sure?"))
    ids, mask, _, _ = expected_sequence(script[1:3], [bridge])
    assert (trajectory.prompt_ids, trajectory.response_ids, trajectory.loss_mask) == (anew, ids, mask)
    assert (trajectory.turns, trajectory.branches) == (2, 2)


def test_an_assistant_message_the_endpoint_did_not_return_is_masked_context_and_counted(
    endpoint_of, sampled, encode, run_agent
):
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    script = [sampled("Hi.", 1), sampled("I will add. " + call, 1), sampled("3", 2)]
    endpoint, generator = endpoint_of(script)

    async def agent(client):
        messages = [{"role": "user", "content": "Hello."}]
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        messages += [reply.choices[0].message.model_dump(), {"role": "user", "content": "1 + 2?"}]
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message.model_dump()
        message["content"] = None  # the agent drops the text before the tool call
        messages += [message, {"role": "tool", "tool_call_id": "x", "content": "3"}]
        await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)

    _, trajectory = run_agent(endpoint, agent)
    # the edited turn is not the second completion's: the third continues the first, the edited text masked context
    first = script[0]
    sent = (
        "\n"
        + turn("user", "1 + 2?")
        + turn("assistant", call.replace("<tool_call>", "<tool_call>\n").replace("</tool_call>", "\n</tool_call>"))
        + turn("tool", "3")
        + "<|im_start|>assistant\n"
    )
    prompt = list(generator.requests[0].prompt_ids)
    assert list(generator.requests[2].prompt_ids) == prompt + first.token_ids + encode(sent)
    assert (trajectory.retokenize_mismatch, trajectory.turns, trajectory.branches) == (1, 2, 1)
    ids, mask, _, _ = expected_sequence([first, script[2]], [encode(sent)])
    assert (trajectory.response_ids, trajectory.loss_mask) == (ids, mask)


def test_a_well_behaved_agent_that_branches_trains_its_longest_chain(endpoint_of, sampled, run_agent):
    script = [sampled("A", 1), sampled("B", 1), sampled("C", 1)]
    endpoint, _ = endpoint_of(script)

    async def agent(client):
        user = [{"role": "user", "content": "Go."}]
        first = await client.chat.completions.create(model="policy", messages=user)
        more = user + [first.choices[0].message.model_dump(), {"role": "user", "content": "More."}]
        await client.chat.completions.create(model="policy", messages=more)
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Judge."}])

    _, trajectory = run_agent(endpoint, agent)
    # a side conversation is a branch, not a mismatch: it re-encodes no sampled tokens
    assert (trajectory.turns, trajectory.branches, trajectory.retokenize_mismatch) == (2, 1, 0)
    assert sum(trajectory.loss_mask) == len(script[0].token_ids) + len(script[1].token_ids)


def test_tool_call_blocks_parse_into_openai_calls_and_a_broken_one_stays_text():
    text = 'Let me add. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call> <tool_call>{oops}</tool_call>'
    content, calls, failures = parse_tool_calls(text)
    assert content == "Let me add.  <tool_call>{oops}</tool_call>"
    assert failures == 1
    assert [(c["type"], c["function"]) for c in calls] == [("function", {"name": "add", "arguments": '{"a": 1}'})]
    assert calls[0]["id"].startswith("call_") and len(calls[0]["id"]) == len("call_") + 24
    assert parse_tool_calls("no calls here ") == ("no calls here ", [], 0)


def test_an_assistant_message_sent_back_with_empty_content_for_none_is_the_one_returned(
    endpoint_of, sampled, encode, run_agent
):
    script = [sampled('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>', 1), sampled("3", 1)]
    endpoint, generator = endpoint_of(script)

    async def agent(client):
        messages = [{"role": "user", "content": "1 + 2?"}]
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message.model_dump(exclude_none=True)
        assert "content" not in message  # None: the reply has only a tool call
        messages += [{**message, "content": ""}, {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
        await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)

    _, trajectory = run_agent(endpoint, agent)
    prompt = list(generator.requests[0].prompt_ids)
    assert list(generator.requests[1].prompt_ids) == prompt + script[0].token_ids + encode(bridge_text("tool", "3"))
    assert (trajectory.retokenize_mismatch, trajectory.turns) == (0, 2)


def test_sampled_text_the_template_renders_otherwise_is_rendered_anew_and_counted(
    endpoint_of, sampled, encode, run_agent, caplog
):
    # the model wrote the text "<|im_end|>" in byte tokens: rendered, it becomes the special token, so the render of the
    # conversation so far no longer decodes as the sampled ids do, and the head check must refuse the bridge
    written_end = encode("<|im") + encode("_end|>")
    first, second = sampled(encode("A") + written_end + encode("B"), 1), sampled("C", 2)
    endpoint, generator = endpoint_of([first, second])

    async def agent(client):
        messages = [{"role": "user", "content": "Go."}]
        reply = await client.chat.completions.create(model="policy", messages=messages)
        messages += [reply.choices[0].message.model_dump(), {"role": "user", "content": "Next?"}]
        await client.chat.completions.create(model="policy", messages=messages)
        return reply.choices[0].message.content

    with caplog.at_level(logging.WARNING, logger="dppo.rollout.agent"):
        text, trajectory = run_agent(endpoint, agent)
    assert text == "A<|im_end|>B"
    anew = encode(
        turn("system", SMOLLM_SYSTEM)
        + turn("user", "Go.")
        + turn("assistant", "A<|im_end|>B")
        + turn("user", "Next?")
        + "<|im_start|>assistant\n"
    )
    assert list(generator.requests[1].prompt_ids) == anew
    assert (trajectory.retokenize_mismatch, trajectory.turns, trajectory.branches) == (1, 1, 1)
    assert any("otherwise than its tokens decode" in r.getMessage() for r in caplog.records)
