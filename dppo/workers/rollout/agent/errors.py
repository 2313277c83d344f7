"""The agent endpoint's errors. Each derives from the matching builtin; the endpoint answers a request that raised
an AgentRequestError with its status and message in OpenAI's error format ({"error": {"message", "type", "param",
"code"}}), which the openai client raises as BadRequestError (400), NotFoundError (404) or ConflictError (409)."""

from __future__ import annotations


class AgentRequestError(ValueError):
    """A request the endpoint refuses (HTTP 400): a malformed body, a sampling setting other than the run's, a field
    the endpoint does not support. param: the request field at fault (OpenAI's error.param), or None."""

    status = 400
    code = "invalid_request"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class SamplingMismatchError(AgentRequestError):
    """The request asks for a sampling setting (temperature, top_p, top_k, stop, n, penalties...) that differs from
    the run's: the behaviour log-probs must be those of the distribution the tokens were sampled from."""

    code = "sampling_mismatch"


class TurnLimitError(AgentRequestError):
    """The agent run already made rollout.agent.max_turns completions."""

    code = "max_turns"


class TokenBudgetError(AgentRequestError):
    """The agent run's trajectory has no response tokens left (data.max_response_length), or its first prompt is longer
    than rollout.agent.max_prompt_length."""

    code = "max_response_tokens"


class UnknownSessionError(AgentRequestError, KeyError):
    """A session id that the endpoint does not hold (never created, or closed): HTTP 404."""

    status = 404
    code = "unknown_session"

    def __str__(self) -> str:  # KeyError.__str__ would quote the message
        return str(self.args[0]) if self.args else ""


class SessionClosedError(AgentRequestError):
    """The session was closed while this request was generating: its completion is not recorded (HTTP 409)."""

    status = 409
    code = "session_closed"


class EndpointSecurityError(ValueError):
    """The endpoint would be reachable from other hosts without a token: it refuses to start."""


class GeneratorContractError(RuntimeError):
    """The TokenGenerator returned a Completion that breaks its contract (lengths that differ, an empty or too long
    completion, a finish reason that is neither "stop" nor "length"): HTTP 500."""


class StitchError(ValueError):
    """The chat template does not render the conversation so far as the tokens the ledger holds for it: the request is
    rendered anew (counted in agent/retokenize_mismatch)."""
