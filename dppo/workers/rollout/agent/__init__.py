"""Agentic RL: an OpenAI-compatible endpoint inside each rollout worker, over its generation engine, and the token
ledger that turns an agent run's completions into one training sequence.

An agent is plain Python, `async def agent(client: openai.AsyncOpenAI, row) -> float | dict`; its client points at
the endpoint, one session per agent run. Every completion the agent asks for is one turn of its trajectory; the
trainer gets ONE token sequence per run: the first prompt's ids, then the model's sampled ids (loss mask 1, with
their behaviour log-probs and weight versions) interleaved with everything between turns (template tokens, tool
results, env and user messages: mask 0). Token in, token out: sampled ids are never decoded and re-encoded.

    generator.py  the interface to the engine: TokenGenerator (CompletionRequest -> Completion), SamplingSettings
    chat.py       messages -> token ids with the tokenizer's chat template; the bridge between two turns
    tools.py      Hermes tool blocks for templates without tools; <tool_call> parsing into OpenAI tool_calls
    ledger.py     sessions, their records, the trajectory (mask, log-prob and version rules), the limits
    protocol.py   the wire format: what a request may ask (the sampling rule), vLLM's token fields in responses
    endpoint.py   the aiohttp server (AgentEndpoint): routes, lifecycle, the security model
    errors.py     the typed errors and their HTTP statuses

The package imports none of its modules: endpoint.py needs aiohttp and client() openai (the agents extra).
"""
