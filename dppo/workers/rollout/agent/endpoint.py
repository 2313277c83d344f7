"""The OpenAI-compatible HTTP endpoint a rollout worker runs for its agents, over its generation engine.

    endpoint = AgentEndpoint(generator, tokenizer, settings, limits)   # token=None: 127.0.0.1 only
    base_url = await endpoint.start()                    # an ephemeral port, in the running asyncio loop
    session = endpoint.new_session(greedy=False)         # one per agent run
    client = endpoint.client(session)                    # openai.AsyncOpenAI at base_url/s/<session>/v1
    reward = await agent(client, row); await client.close()
    trajectory = endpoint.close_session(session)         # the ledger's one sequence for the trainer
    await endpoint.stop()

Routes, per session (the id in the path is how the ledger knows which agent run a request belongs to):

    POST /s/<session>/v1/chat/completions   messages in (tools optional), an assistant message out
    POST /s/<session>/v1/completions        prompt as token ids (token in; a string is encoded with the
                                            tokenizer's own special tokens, as vLLM does), text and token ids out
    GET  /s/<session>/v1/models             the one model, model_name

Anything else is a 404 (a known path with another method: 405); there is no listing, no debug page, no other file.
Non-streaming only: stream=true is a 400. What requests may ask for, and what the responses carry (OpenAI's format
with vLLM's prompt_token_ids, choices[].token_ids and logprobs.content): dppo.workers.rollout.agent.protocol. How
messages become token ids without re-encoding sampled tokens: chat.py; what is recorded and what the trainer gets:
ledger.py.

Security model. The endpoint is a way into the rollout worker's engine (it spends the worker's compute and shapes its
training data), so it binds 127.0.0.1 by default: only processes of the worker's own machine reach it. Bound to any
other address it requires a per-run token (new_token()): constructing it without one raises EndpointSecurityError,
so it never starts open. With a token set (on 127.0.0.1 too) every request must carry `Authorization: Bearer
<token>` (the openai client's api_key; client() sets it), compared in constant time; one without it or with another
gets a 401 before anything else is looked at. The token says nothing about which session a request may use: every
agent of the run is trusted alike. Request bodies are capped at max_body_bytes.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import secrets
import time

try:
    from aiohttp import web
except ImportError:  # the agents extra: importing this module works without it, starting an endpoint does not
    web = None
_middleware = web.middleware if web is not None else (lambda fn: fn)  # aiohttp's mark of a request middleware

from dppo.data.errors import require_extra
from dppo.workers.rollout.agent import protocol
from dppo.workers.rollout.agent.chat import ChatFormat, normalised_message
from dppo.workers.rollout.agent.errors import AgentRequestError, EndpointSecurityError, SessionClosedError
from dppo.workers.rollout.agent.generator import (
    Completion,
    CompletionRequest,
    SamplingSettings,
    TokenGenerator,
    check_completion,
)
from dppo.workers.rollout.agent.ledger import AgentLimits, Ledger, Plan, Session, Trajectory, TurnRecord
from dppo.workers.rollout.agent.tools import parse_tool_calls

log = logging.getLogger("dppo.rollout.agent")

_UNSPECIFIED = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def new_token() -> str:
    """A fresh per-run token (256 random bits)."""
    return secrets.token_urlsafe(32)


def is_loopback(host: str) -> bool:
    """Whether binding host keeps the endpoint reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


class AgentEndpoint:
    """An aiohttp server over a TokenGenerator, a tokenizer's chat template and a Ledger (see the module docstring).

    generator: the engine (generator.TokenGenerator). tokenizer: a transformers tokenizer with a chat template.
    settings: how the run samples. limits: per agent run. host, port: where to bind (port 0: an ephemeral one).
    token: the per-run token (required where host is not a loopback address). model_name: what /v1/models lists and
    responses name. client_timeout_s: the timeout of client()'s clients. max_body_bytes: the largest request body."""

    def __init__(
        self,
        generator: TokenGenerator,
        tokenizer,
        settings: SamplingSettings,
        limits: AgentLimits,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        model_name: str = "dppo-policy",
        client_timeout_s: float = 600.0,
        max_body_bytes: int = 32 * 2**20,
    ):
        if web is None:
            require_extra("aiohttp", "agents", "rollout.agent (the agents' endpoint)")
        if not is_loopback(host) and not token:
            raise EndpointSecurityError(
                f"the agent endpoint bound to host={host!r} would serve other machines: give it a token "
                "(AgentEndpoint(..., token=new_token())) or bind 127.0.0.1"
            )
        self.generator, self.tokenizer, self.settings = generator, tokenizer, settings
        self.chat = ChatFormat(tokenizer, settings.end_token_id)
        self.ledger = Ledger(limits)
        self.host, self.port, self.token = host, port, token
        self.model_name, self.client_timeout_s, self.max_body_bytes = model_name, client_timeout_s, max_body_bytes
        self._runner: web.AppRunner | None = None
        self._seed_warned = False

    # lifecycle

    async def start(self) -> str:
        """Serve in the running asyncio loop; returns the base URL (http://HOST:PORT, HOST where clients connect)."""
        if self._runner is not None:
            raise RuntimeError(f"the agent endpoint already serves at {self.base_url}")
        app = web.Application(middlewares=[self._guard], client_max_size=self.max_body_bytes)
        app.router.add_post("/s/{session}/v1/chat/completions", self._chat_completions)
        app.router.add_post("/s/{session}/v1/completions", self._completions)
        app.router.add_get("/s/{session}/v1/models", self._models)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner, self.port = runner, runner.addresses[0][1]
        return self.base_url

    async def stop(self) -> None:
        """Stop serving; open sessions are dropped (close them first to keep their trajectories)."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def __aenter__(self) -> AgentEndpoint:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    @property
    def base_url(self) -> str:
        host = _UNSPECIFIED.get(self.host, self.host)
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def session_url(self, session: str) -> str:
        """The OpenAI base_url of a session."""
        return f"{self.base_url}/s/{session}/v1"

    def new_session(self, greedy: bool = False) -> str:
        """A new agent run's session id. greedy: decode greedily (evaluation)."""
        return self.ledger.new_session(greedy)

    def close_session(self, session: str) -> Trajectory:
        """The session's trajectory; the session is freed."""
        return self.ledger.close(session)

    def client(self, session: str):
        """An openai.AsyncOpenAI for session: its api_key the token, no retries (a retried completion would be a
        second sample), client_timeout_s, and no proxy from the environment. The caller closes it (await
        client.close())."""
        import openai  # the agents extra

        return openai.AsyncOpenAI(
            api_key=self.token or "no-token",
            base_url=self.session_url(session),
            max_retries=0,
            timeout=self.client_timeout_s,
            http_client=openai.DefaultAsyncHttpxClient(trust_env=False, timeout=self.client_timeout_s),
        )

    # serving

    @_middleware
    async def _guard(self, request: web.Request, handler):
        """The token check before anything else; refusals and failures as OpenAI error bodies."""
        if self.token is not None:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, f"Bearer {self.token}".encode()):
                body = {"error": {"message": "missing or wrong token", "type": "authentication_error"}}
                return web.json_response(body, status=401)
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except AgentRequestError as error:
            return web.json_response(protocol.error_body(error), status=error.status)
        except Exception as error:  # the engine failed: the agent sees a 500, the worker's log the traceback
            log.exception("agent endpoint: %s %s failed", request.method, request.path)
            body = {"error": {"message": f"{type(error).__name__}: {error}", "type": "server_error"}}
            return web.json_response(body, status=500)

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise AgentRequestError(f"the request body is not JSON: {error}") from error
        if not isinstance(body, dict):
            raise AgentRequestError("the request body must be a JSON object")
        if body.get("seed") is not None and not self._seed_warned:
            self._seed_warned = True
            log.warning("agent endpoint: 'seed' is ignored (the rollout worker seeds its own sampling streams)")
        return body

    async def _models(self, request: web.Request) -> web.Response:
        self.ledger.session(request.match_info["session"])
        return web.json_response(protocol.models_response(self.model_name))

    async def _generate(self, session: Session, plan: Plan, asked: int | None) -> Completion:
        """The engine's completion for plan, with max_tokens cut to the session's budget (inside session.turn())."""
        max_tokens = session.max_tokens(plan, asked or self.settings.max_tokens)
        request = CompletionRequest(tuple(plan.prompt_ids), max_tokens, session.greedy)
        start = time.perf_counter()
        completion = await self.generator.generate(request)
        session.generate_s += time.perf_counter() - start
        check_completion(completion, request, self.settings.stop_token_ids)
        if session.closed:
            raise SessionClosedError(f"agent session {session.id} was closed while this completion generated")
        if plan.mismatch is not None:
            session.count_mismatch(plan.mismatch)
        return completion

    def _sampled_text(self, completion: Completion) -> str:
        """The exact text of the sampled ids, without the stop token that ended them."""
        ids = completion.token_ids[:-1] if completion.finish_reason == "stop" else completion.token_ids
        return self.chat.decode(ids)

    def _token_texts(self, ids: list[int]) -> list[str]:
        return [self.chat.decode([t]) for t in ids]

    def _record(
        self,
        session: Session,
        kind: str,
        plan: Plan,
        completion: Completion,
        text: str,
        messages: list[dict] | None = None,
        output: dict | None = None,
    ) -> None:
        session.record(
            TurnRecord(
                index=-1,
                kind=kind,
                messages=messages,
                output=output,
                prompt_ids=list(plan.prompt_ids),
                completion_ids=list(completion.token_ids),
                logprobs=[float(x) for x in completion.logprobs],
                versions=[int(v) for v in completion.versions],
                finish_reason=completion.finish_reason,
                parent=None if plan.parent is None else plan.parent.index,
                text=text,
            )
        )

    async def _chat_completions(self, request: web.Request) -> web.Response:
        session = self.ledger.session(request.match_info["session"])
        chat = protocol.parse_chat(await self._body(request), self.settings)
        with session.turn():  # refused beyond max_turns before anything is rendered
            plan = session.plan_chat(self.chat, chat.messages, chat.tools)
            completion = await self._generate(session, plan, chat.max_tokens)
        text = self._sampled_text(completion)
        content, calls, failures = parse_tool_calls(text) if chat.parse_tools else (text, [], 0)
        session.tool_parse_failures += failures
        message = {"role": "assistant", "content": content if content or not calls else None}
        if calls:
            message["tool_calls"] = calls
        output = normalised_message(message)
        self._record(session, "chat", plan, completion, text, messages=chat.messages, output=output)
        finish = "tool_calls" if calls else completion.finish_reason
        logprobs = None
        if chat.logprobs:
            logprobs = protocol.chat_logprobs(self._token_texts(completion.token_ids), completion.logprobs)
        body = protocol.chat_response(self.model_name, plan.prompt_ids, completion.token_ids, message, finish, logprobs)
        return web.json_response(body)

    async def _completions(self, request: web.Request) -> web.Response:
        session = self.ledger.session(request.match_info["session"])
        text_request = protocol.parse_text(await self._body(request), self.settings)
        prompt = text_request.prompt
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        with session.turn():
            plan = session.plan_tokens(prompt_ids)
            completion = await self._generate(session, plan, text_request.max_tokens)
        text = self._sampled_text(completion)
        self._record(session, "text", plan, completion, text)
        logprobs = None
        if text_request.logprobs:
            logprobs = protocol.text_logprobs(self._token_texts(completion.token_ids), completion.logprobs)
        body = protocol.text_response(
            self.model_name, plan.prompt_ids, completion.token_ids, text, completion.finish_reason, logprobs
        )
        return web.json_response(body)
