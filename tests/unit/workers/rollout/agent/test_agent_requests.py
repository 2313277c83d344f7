"""What the agent endpoint refuses (sampling other than the run's, n > 1, streaming, the run's limits), who may call it
(the per-run token), and token-in /v1/completions."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from dppo.workers.rollout.agent.errors import EndpointSecurityError
from dppo.workers.rollout.agent.generator import Completion

USER = [{"role": "user", "content": "What is 12 + 7?"}]


async def refusal(client, **kwargs) -> str:
    """The message of the 400 a chat request with kwargs gets."""
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model="policy", messages=USER, **kwargs)
    return refused.value.body["message"]


def test_sampling_other_than_the_runs_is_refused_naming_the_field_and_the_runs_value(endpoint_of, sampled, run_agent):
    endpoint, generator = endpoint_of([sampled("19", 1)], temperature=0.8)
    asked = {
        "temperature=0.5": {"temperature": 0.5},
        "temperature=0": {"temperature": 0},
        "top_p=0.9": {"top_p": 0.9},
        "top_k=5": {"extra_body": {"top_k": 5}},
        "presence_penalty=0.5": {"presence_penalty": 0.5},
        "stop=": {"stop": ["\n"]},
        "n=2": {"n": 2},
        "stream=true": {"stream": True},
        "top_logprobs=3": {"logprobs": True, "top_logprobs": 3},
        "max_tokens and max_completion_tokens": {"max_tokens": 5, "max_completion_tokens": 5},
    }

    async def agent(client):
        messages = {what: await refusal(client, **kwargs) for what, kwargs in asked.items()}
        # the run's own values, top_k off, a seed and keys the endpoint does not know are fine
        reply = await client.chat.completions.create(
            model="anything",
            messages=USER,
            temperature=0.8,
            top_p=1.0,
            seed=7,
            extra_body={"top_k": -1, "return_token_ids": True, "some_future_key": 1},
        )
        return messages, reply

    (messages, reply), trajectory = run_agent(endpoint, agent)
    for what, message in messages.items():
        assert message.startswith(what.split("=")[0] if "=" in what else "max_tokens"), (what, message)
    assert "this run samples with temperature=0.8" in messages["temperature=0.5"]
    assert "this run samples with temperature=0.8" in messages["temperature=0"]
    assert "top_p=1.0" in messages["top_p=0.9"] and "top_k=-1" in messages["top_k=5"]
    assert "stop tokens [2]" in messages["stop="]
    assert reply.choices[0].message.content == "19"
    assert len(generator.requests) == 1 and trajectory.turns == 1  # no refused request reached the engine


def test_the_response_budget_cuts_max_tokens_then_refuses_naming_the_key(endpoint_of, sampled, encode, run_agent):
    first = sampled("Twelve plus seven", 1)
    bridge = encode("\n<|im_start|>user\nAnd?<|im_end|>\n<|im_start|>assistant\n")
    budget = len(first.token_ids) + len(bridge) + 3
    endpoint, generator = endpoint_of([first, sampled("is 19.", 1)], max_response_tokens=budget)

    async def agent(client):
        messages = USER + []
        for _ in range(2):
            reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=100)
            messages += [reply.choices[0].message.model_dump(), {"role": "user", "content": "And?"}]
        return await _refused_turn(client, messages)

    message, trajectory = run_agent(endpoint, agent)
    assert budget < 100
    assert [r.max_tokens for r in generator.requests] == [budget, 3]  # each cut to what was left
    assert len(trajectory.response_ids) == budget
    assert trajectory.finish_reason == "length"
    assert "data.max_response_length" in message and "no tokens left" in message


async def _refused_turn(client, messages) -> str:
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model="policy", messages=messages)
    return refused.value.body["message"]


def test_a_completion_beyond_max_turns_is_refused_naming_the_key(endpoint_of, sampled, run_agent):
    endpoint, generator = endpoint_of([sampled("19", 1)], max_turns=1)

    async def agent(client):
        await client.chat.completions.create(model="policy", messages=USER)
        return await _refused_turn(client, USER)

    message, trajectory = run_agent(endpoint, agent)
    assert "rollout.agent.max_turns=1" in message
    assert len(generator.requests) == 1 and trajectory.turns == 1


def test_the_endpoint_refuses_to_serve_other_hosts_without_a_token(endpoint_of):
    with pytest.raises(EndpointSecurityError, match="token") as refused:
        endpoint_of([], host="0.0.0.0")
    assert isinstance(refused.value, ValueError)


def test_a_non_local_client_without_the_token_gets_401(endpoint_of, sampled):
    endpoint, generator = endpoint_of([sampled("19", 1)], host="0.0.0.0", token="s3cret-token")

    async def main():
        base = await endpoint.start()
        try:
            session = endpoint.new_session()
            url = f"{endpoint.session_url(session)}/chat/completions"
            body = {"model": "policy", "messages": USER}
            async with aiohttp.ClientSession() as http:
                statuses = []
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-token"}):
                    async with http.post(url, json=body, headers=headers) as response:
                        statuses.append(response.status)
                right = {"Authorization": "Bearer s3cret-token"}
                async with http.post(url, json=body, headers=right) as response:
                    statuses.append(response.status)
                    reply = await response.json()
                async with http.get(f"{base}/", headers=right) as response:
                    statuses.append(response.status)
                async with http.get(f"{base}/s/{session}/v1/files", headers=right) as response:
                    statuses.append(response.status)
                async with http.get(f"{base}/s/nobody/v1/models", headers=right) as response:
                    statuses.append(response.status)
            return statuses, reply
        finally:
            await endpoint.stop()

    statuses, reply = asyncio.run(main())
    assert statuses == [401, 401, 401, 200, 404, 404, 404]
    assert reply["choices"][0]["message"]["content"] == "19"
    assert len(generator.requests) == 1  # the refused ones never reached the engine


def test_completions_take_token_ids_in_and_give_them_back(endpoint_of, sampled, run_agent):
    first, second = sampled([40, 41, 42], 1), sampled([43, 44], 2, stop=False)
    endpoint, generator = endpoint_of([first, second])
    prompt = [1, 30, 31, 32, 2, 201, 1, 33, 201]

    async def agent(client):
        one = await client.completions.create(model="policy", prompt=prompt, max_tokens=10, logprobs=1)
        env = [201, 1, 34, 2]  # the agent's own tokens between the turns
        two = await client.completions.create(
            model="policy", prompt=prompt + one.choices[0].token_ids + env, max_tokens=2
        )
        return one, two, env

    (one, two, env), trajectory = run_agent(endpoint, agent)
    assert list(generator.requests[0].prompt_ids) == prompt
    assert list(generator.requests[1].prompt_ids) == prompt + first.token_ids + env
    assert one.choices[0].token_ids == first.token_ids and one.choices[0].prompt_token_ids == prompt
    assert one.choices[0].logprobs.token_logprobs == first.logprobs
    assert (two.choices[0].finish_reason, two.choices[0].token_ids) == ("length", [43, 44])
    assert trajectory.prompt_ids == prompt
    assert trajectory.response_ids == first.token_ids + env + second.token_ids
    assert trajectory.loss_mask == [1] * 4 + [0] * 4 + [1] * 2  # 40, 41, 42 and the EOS sampled; env; 43, 44
    assert trajectory.behav_logp == first.logprobs + [0.0] * 4 + second.logprobs
    assert trajectory.versions == [1] * 4 + [1] * 4 + [2] * 2
    assert trajectory.turns == 2


def test_a_completion_that_breaks_the_generators_contract_is_a_500(endpoint_of, run_agent):
    broken = Completion([40, 41, 2], [-0.1], [1, 1, 1], "stop")  # one log-prob for three tokens
    endpoint, _ = endpoint_of([broken])

    async def agent(client):
        with pytest.raises(openai.InternalServerError) as failed:
            await client.chat.completions.create(model="policy", messages=USER)
        return failed.value.body["message"]

    message, trajectory = run_agent(endpoint, agent)
    assert "3 tokens with 1 logprobs" in message
    assert trajectory.turns == 0


def test_an_unknown_session_is_a_404(endpoint_of):
    endpoint, _ = endpoint_of([])

    async def main():
        await endpoint.start()
        try:
            client = endpoint.client("no-such-session")
            with pytest.raises(openai.NotFoundError, match="no agent session"):
                await client.chat.completions.create(model="policy", messages=USER)
            await client.close()
        finally:
            await endpoint.stop()

    asyncio.run(main())


def test_a_greedy_session_asks_the_engine_for_greedy_decoding_and_a_sampling_one_does_not(
    endpoint_of, sampled, run_agent
):
    for greedy in (True, False):
        endpoint, generator = endpoint_of([sampled("19", 1)])

        async def agent(client):
            # the agent's code is the same in training and evaluation: it sends the run's temperature
            await client.chat.completions.create(model="policy", messages=USER, temperature=1.0)

        _, trajectory = run_agent(endpoint, agent, greedy=greedy)
        assert [r.greedy for r in generator.requests] == [greedy]
        assert trajectory.greedy is greedy
