"""verifiers' environments as dppo agents: a rollout of an environment of verifiers' classic API (MultiTurnEnv,
ToolEnv, SingleTurnEnv, an environment package installed by its id) is one agent run, its requests going to the
rollout worker's agent endpoint.

    # the file rollout.agent.path names (rollout.agent.name=agent):
    from dppo.envs.verifiers_env import verifiers_agent
    agent = verifiers_agent(make_env)                   # a function that builds the environment
    agent = verifiers_agent("reverse-text", **env_args) # an installed environment package, by its id

verifiers is the extra dppo[envs] (verifiers>=0.3.1,<0.4: the classic API, which 0.4 replaced by one whose client
renders prompts itself and calls vLLM's own generate route, which a plain OpenAI endpoint cannot serve). It is
imported when an agent is made; without it, or with another verifiers, a MissingExtraError names the extra.

An agent run, on dppo's row {"prompt", "ground_truth", "data_source", "extra_info"}:
1. The row becomes verifiers' rollout input (rollout_input): prompt = the environment's system prompt (where the row
   has no system message of its own), its few_shot messages, then the row's messages; answer = ground_truth as text;
   info = extra_info (a dict; {} otherwise); example_id = a hash of the row's messages (the n runs of a row share it).
   The environment's own dataset is not read: dppo's data source (data.source, data.train_files) gives the rows.
2. env.run_rollout(input, client, "dppo-policy", sampling_args) with verifiers' OpenAIChatCompletionsClient over the
   session's openai client: every turn is a /v1/chat/completions request carrying the whole conversation (and the
   environment's tools), which the endpoint's ledger stitches onto the tokens already sampled.
3. Its output becomes the reward (result_of): {"score": the rubric's reward, the rubric's metrics (num_turns,
   total_tool_calls, <tool>_calls, each reward function's value: logged as agent/<name>), "is_truncated" (verifiers'
   flag: a turn cut by max_tokens, or the rollout by dppo's limits), "invalid_response" (below)}. num_turns counts
   the turns verifiers kept: the endpoint's agent/turns_mean also counts the response a rollout ended on where
   verifiers refused it (that response is trained on, with the rollout's reward).

Sampling: the environment's sampling_args with those given here over them (as verifiers' own generate merges them).
The endpoint samples at the run's rollout.temperature and refuses a request that asks for anything else (HTTP 400):
leave temperature, top_p and the like out, or give the run's values. max_tokens is the one to set, per turn.

dppo's own limits end a rollout, scored on what it holds, as truncated: a request refused for rollout.agent.max_turns
or for the run's token budget (data.max_response_length, rollout.agent.max_prompt_length) reaches verifiers as its
OverlongPromptError (stop condition prompt_too_long, is_truncated 1). A rollout that ends on a response verifiers
refuses (empty, no content and no tool call; a tool error of the environment's stop_errors) is the policy's doing:
it is scored and counted in invalid_response. Any other error (a request the endpoint refused, a failure of the
environment's code) raises VerifiersRolloutError with verifiers' error chain: the run counts one agent/errors and its
message is logged (dppo.workers.rollout.agent.runner).

Signal handlers: verifiers' Environment.__init__ installs SIGINT and SIGTERM handlers of its own (its teardown, then
exit 143). That would replace `dppo train`'s (dppo.stopping) and a local rollout worker's, and it fails outside the
main thread (where a rollout worker loads the agent file). verifiers_agent builds the environment with them left as
they are; an environment built before (passed as an instance) has installed its own.

Groups: dppo runs each rollout as its own agent run (rollout.n of them per row) and computes the advantages itself,
so an environment whose rubric scores a group of rollouts together, or provides advantages, is refused.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import numbers
import signal
import threading
import zlib
from collections.abc import Callable
from copy import deepcopy

from dppo.data.errors import MissingExtraError, require_extra

EXTRA = "envs"
MODEL = "dppo-policy"  # the model name requests carry (the endpoint serves one model and ignores it)
# the error codes of the endpoint's refusals for the run's limits (dppo.workers.rollout.agent.errors: TurnLimitError,
# TokenBudgetError); written out here because this package sits below the workers in the import layers
LIMIT_CODES = frozenset({"max_turns", "max_response_tokens"})
# verifiers' errors of a response it refuses (the policy's doing): the rollout is scored, not failed
POLICY_ERRORS = frozenset(
    {"InvalidModelResponseError", "EmptyModelResponseError", "ToolError", "ToolParseError", "ToolCallError"}
)

_build_lock = threading.Lock()


class VerifiersEnvError(ValueError):
    """The environment cannot run as a dppo agent (not a verifiers Environment; its rubric scores groups)."""


class VerifiersRolloutError(RuntimeError):
    """A rollout ended on an error that is not the policy's (the endpoint refused a request, the environment's code
    failed): the agent run fails with verifiers' error chain."""


def classic_verifiers(needed_by: str = "verifiers_agent"):
    """The verifiers package, its classic API checked (MissingExtraError naming the extra where it is missing)."""
    vf = require_extra("verifiers", EXTRA, needed_by)
    try:
        vf.MultiTurnEnv, vf.OpenAIChatCompletionsClient  # noqa: B018  the classic API (verifiers.legacy in 0.3)
    except (AttributeError, ImportError) as err:
        version = getattr(vf, "__version__", "of unknown version")
        raise MissingExtraError(
            f"{needed_by} needs verifiers' classic environments (MultiTurnEnv, ToolEnv, OpenAIChatCompletionsClient), "
            f"which verifiers {version} lacks ({type(err).__name__}: {err}); install the extra: pip install "
            f"'dppo[{EXTRA}]' (verifiers>=0.3.1,<0.4)"
        ) from None
    return vf


class _SignalsLeftAlone:
    """The `signal` module as verifiers' Environment.__init__ sees it while verifiers_agent builds one: handlers
    are read, never installed."""

    def __getattr__(self, name: str):
        return getattr(signal, name)

    @staticmethod
    def signal(signum, handler):
        return signal.getsignal(signum)


@contextlib.contextmanager
def _handlers_left_alone(vf):
    """While the block runs, verifiers' environment module installs no signal handler (any thread may run it)."""
    module = importlib.import_module(vf.Environment.__module__)
    with _build_lock:
        real = module.signal
        module.signal = _SignalsLeftAlone()
        try:
            yield
        finally:
            module.signal = real


def build_env(env, env_args: dict | None = None):
    """The verifiers Environment env names: an instance as it is, a callable's return value, or a string's
    load_environment(env, **env_args) (an installed environment package), the latter two built with the process's
    signal handlers left alone. VerifiersEnvError where it is not a verifiers Environment or scores groups."""
    vf = classic_verifiers()
    if env_args and not isinstance(env, str):
        raise VerifiersEnvError(f"environment arguments {sorted(env_args)} are for an environment id (a string)")
    if not isinstance(env, vf.Environment):
        with _handlers_left_alone(vf):
            env = vf.load_environment(env, **(env_args or {})) if isinstance(env, str) else env()
    if not isinstance(env, vf.Environment):
        raise VerifiersEnvError(f"expected a verifiers Environment, got {type(env).__name__}: {env!r:.80}")
    if env.requires_group_rollouts or env.provides_advantages:
        raise VerifiersEnvError(
            f"{type(env).__name__}'s rubric scores groups of rollouts together (group reward functions or "
            "advantages): dppo runs each rollout as its own agent run and computes the advantages itself"
        )
    return env


def rollout_input(env, row: dict) -> dict:
    """verifiers' rollout input of dppo's agent row (see the module docstring, step 1)."""
    messages = [dict(m) for m in row["prompt"]]
    own_system = messages[:1] if messages and messages[0].get("role") == "system" else []
    system = own_system or ([{"role": "system", "content": env.system_prompt}] if env.system_prompt else [])
    few_shot = [dict(m) for m in (env.few_shot or [])]
    answer = row.get("ground_truth")
    info = row.get("extra_info")
    return {
        "prompt": system + few_shot + messages[len(own_system) :],
        "answer": "" if answer is None else str(answer),
        "info": dict(info) if isinstance(info, dict) else {},
        "example_id": zlib.crc32(json.dumps(row["prompt"], sort_keys=True, default=str).encode()),
    }


def result_of(output: dict) -> dict:
    """The agent's return value of verifiers' rollout output (see the module docstring, step 3);
    VerifiersRolloutError where it ended on an error that is not the policy's."""
    error = output.get("error")
    if error is not None and error.get("error") not in POLICY_ERRORS:
        raise VerifiersRolloutError(f"the rollout failed: {error.get('error_chain_repr') or error}")
    reward = output.get("reward")
    if not isinstance(reward, numbers.Real):
        raise VerifiersRolloutError(f"the rollout was not scored (reward {reward!r})")
    metrics = {
        ("metric_score" if key == "score" else key): float(value)
        for key, value in (output.get("metrics") or {}).items()
        if isinstance(value, numbers.Real)
    }
    return {
        "score": float(reward),
        **metrics,
        "is_truncated": float(bool(output.get("is_truncated"))),
        "invalid_response": float(error is not None),
    }


def _endpoint_client_class(vf) -> type:
    """verifiers' chat client, with the endpoint's refusals for the run's limits raised as OverlongPromptError."""
    import openai  # the agents extra (verifiers depends on it too)

    class EndpointChatClient(vf.OpenAIChatCompletionsClient):
        async def get_native_response(self, *args, **kwargs):
            try:
                return await super().get_native_response(*args, **kwargs)
            except openai.BadRequestError as err:
                if getattr(err, "code", None) in LIMIT_CODES:
                    raise vf.OverlongPromptError(str(err)) from err
                raise

    return EndpointChatClient


def sampling_of(env, sampling_args: dict | None) -> dict:
    """The environment's sampling_args with sampling_args over them (extra_body merged), as verifiers' generate."""
    merged = deepcopy(dict(env.sampling_args or {}))
    for key, value in (sampling_args or {}).items():
        if key == "extra_body":
            merged["extra_body"] = {**(merged.get("extra_body") or {}), **value}
        else:
            merged[key] = value
    return merged


def verifiers_agent(env: object, sampling_args: dict | None = None, **env_args) -> Callable:
    """A dppo agent, `async def agent(client, row) -> dict`, that runs one rollout of the verifiers environment env
    per call (see the module docstring). env: a function that builds it (called once, now), an environment id (a
    string: an installed environment package, loaded with env_args), or an Environment. sampling_args: verifiers'
    sampling arguments (max_tokens per turn, say) over the environment's own."""
    vf = classic_verifiers()
    built = build_env(env, env_args)
    client_class = _endpoint_client_class(vf)
    sampling = sampling_of(built, sampling_args)

    async def agent(client, row: dict) -> dict:
        output = await built.run_rollout(rollout_input(built, row), client_class(client), MODEL, deepcopy(sampling))
        return result_of(output)

    agent.env = built  # the environment, for a look at it (its tools, its rubric)
    return agent
