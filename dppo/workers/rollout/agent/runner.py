"""rollout.agent: a ticket's groups made by the user's agent, run rollout.n times on each row through the endpoint.

    rollout = AgentRollout(agent, engine, tokenizer, settings, limits, max_concurrency, timeout_s)
    runs = rollout.run(rows, n, version, refresh)        # rows: the ticket's RewardRows; n runs each, row-major
    groups = agent_groups(runs, n, prompts, version, pad_token)
    rollout.close()

An agent is plain Python, named in the config as a reward function is (rollout.agent.path, rollout.agent.name):

    async def agent(client: openai.AsyncOpenAI, row: dict) -> float | dict

client talks to the worker's own endpoint (dppo.workers.rollout.agent.endpoint) in a session of its own; row is the
data row ({"prompt": its messages, "ground_truth", "data_source", "extra_info"}). The return value is the reward: a
float, or a dict with "score" whose other numeric entries are logged as agent/<key> means.

The endpoint, the agents and their tools run on one asyncio loop on a thread of this worker's (started once, kept
across tickets); the engine generates on another (dppo.workers.rollout.agent.driver), so tools and environments run
while it generates. At most max_concurrency agent runs are in flight at once.

An agent run that raises, returns something that is not a reward, or takes longer than timeout_s gets reward 0 and
counts one agent/errors, with one log line per distinct failure of a ticket; its trajectory keeps what it sampled
(masked out of nothing: its tokens train toward the 0 reward like any other). The run goes on. A failure of the
engine is not the agent's: it fails the ticket (RolloutEngineError), as it would without agents.

Per run, besides the reward (reward_extra of its group, logged by the trainer): agent/turns_mean (completions on the
trained chain), agent/masked_token_frac (response tokens not sampled: template, tool and environment tokens),
agent/env_time_s (the run's wall time not spent waiting for completions: tools, environments, the agent's own code),
and the counts agent/errors, agent/retokenize_mismatch and agent/tool_parse_failures (summed over a step).
"""

from __future__ import annotations

import asyncio
import logging
import math
import numbers
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from dppo._text import one_line
from dppo.batch import AGENT_COUNTS, Group  # noqa: F401  AGENT_COUNTS: the agent/* counts of stats()
from dppo.data.rewards import RewardRow
from dppo.data.user_code import FileFunction
from dppo.workers.rollout.agent.driver import EngineDriver
from dppo.workers.rollout.agent.endpoint import AgentEndpoint, is_loopback, new_token
from dppo.workers.rollout.agent.generator import Completion, CompletionRequest, SamplingSettings
from dppo.workers.rollout.agent.ledger import AgentLimits, Trajectory
from dppo.workers.rollout.engines.base import Refresh, RolloutEngine, TokenRequest

log = logging.getLogger("dppo.rollout.agent")


class AgentError(RuntimeError):
    """The agent function cannot be used at all (a file that does not load, a name it does not define)."""


class RolloutEngineError(RuntimeError):
    """The engine failed while agents waited on it: the ticket fails (not counted against the agents)."""


@dataclass
class AgentRun:
    """One run of the agent on one row: its trajectory (the ledger's), its reward and what it reported."""

    trajectory: Trajectory
    reward: float
    extras: dict[str, float] = field(default_factory=dict)  # the agent's own numbers, as agent/<key>
    error: str | None = None  # why it got reward 0: "raised ...", "returned ...", "took longer than ..."
    wall_s: float = 0.0
    generate_s: float = 0.0  # time its completions took, waiting included

    def stats(self) -> dict[str, float]:
        """Its agent/* values (see the module docstring) and the agent's own extras."""
        t = self.trajectory
        return {
            "agent/turns_mean": float(t.turns),
            "agent/masked_token_frac": float(t.masked_token_frac),
            "agent/env_time_s": max(0.0, self.wall_s - self.generate_s),
            "agent/errors": float(self.error is not None),
            "agent/retokenize_mismatch": float(t.retokenize_mismatch),
            "agent/tool_parse_failures": float(t.tool_parse_failures),
            **self.extras,
        }


def reward_of(result: object) -> tuple[float, dict[str, float]]:
    """(reward, agent/<key> extras) of what an agent returned; ValueError naming what was wrong."""
    extras: dict[str, float] = {}
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"returned a dict without 'score' (keys: {', '.join(map(str, result)) or 'none'})")
        extras = {f"agent/{k}": float(v) for k, v in result.items() if k != "score" and _is_real(v)}
        result = result["score"]
    if not _is_real(result):
        shown = one_line(repr(result), None)[:80]
        raise ValueError(f"returned {type(result).__name__} {shown}; expected a float or a dict with 'score'")
    if not math.isfinite(float(result)):
        raise ValueError(f"returned the non-finite reward {float(result)}")
    return float(result), extras


def _is_real(value: object) -> bool:
    return isinstance(value, (numbers.Real, np.bool_)) and not isinstance(value, complex)


class _TicketGenerator:
    """The endpoint's TokenGenerator: completions on the engine driver of the ticket being generated."""

    def __init__(self) -> None:
        self.driver: EngineDriver | None = None

    async def generate(self, request: CompletionRequest) -> Completion:
        if self.driver is None:
            raise RuntimeError("no ticket is being generated: the agent endpoint has no engine to use")
        out = await self.driver.generate(TokenRequest(tuple(request.prompt_ids), request.max_tokens, request.greedy))
        logprobs = out.logprobs if out.logprobs is not None else [0.0] * len(out.token_ids)  # greedy: not scored
        return Completion(out.token_ids, logprobs, out.versions, out.finish_reason)


class AgentRollout:
    """The agent runtime of one rollout worker (see the module docstring)."""

    def __init__(
        self,
        agent: FileFunction,
        engine: RolloutEngine,
        tokenizer,
        settings: SamplingSettings,
        limits: AgentLimits,
        max_concurrency: int,
        timeout_s: float,
        host: str = "127.0.0.1",
        token: str | None = None,
    ):
        self.agent, self.engine = agent, engine
        self.max_concurrency, self.timeout_s = max_concurrency, timeout_s
        self._generator = _TicketGenerator()
        self.endpoint = AgentEndpoint(self._generator, tokenizer, settings, limits, host=host, token=token)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="dppo-agents", daemon=True)
        self._thread.start()
        self.base_url = self._call(self.endpoint.start())

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def run(
        self, rows: Sequence[RewardRow], n: int, version: int, refresh: Refresh | None = None, greedy: bool = False
    ) -> list[AgentRun]:
        """n runs of the agent on each row (row-major), the engine sampling with the weights of version loaded now
        (refresh: rollout.partial_rollout's look for newer ones; greedy: evaluation, decoded greedily)."""
        return self._call(self._run(rows, n, version, None if greedy else refresh, greedy))

    async def _run(self, rows, n: int, version: int, refresh, greedy: bool) -> list[AgentRun]:
        loop = asyncio.get_running_loop()
        driver = EngineDriver(self.engine.token_stream(version, refresh), loop)
        self._generator.driver = driver
        slots = asyncio.Semaphore(self.max_concurrency)
        failures: dict[str, int] = {}
        try:
            runs = await asyncio.gather(*(self._one(row, slots, greedy, failures) for row in rows for _ in range(n)))
        finally:
            self._generator.driver = None
            await loop.run_in_executor(None, driver.close)
        if driver.error is not None:
            raise RolloutEngineError(f"the rollout engine failed while agents waited on it: {driver.error}")
        for message, count in failures.items():
            log.warning("agent %s: %s (%d of %d runs of this ticket)", self.agent.label, message, count, len(runs))
        return runs

    async def _one(self, row: RewardRow, slots: asyncio.Semaphore, greedy: bool, failures: dict) -> AgentRun:
        async with slots:
            session = self.endpoint.new_session(greedy)
            client = self.endpoint.client(session)
            start = time.perf_counter()
            reward, extras, error = 0.0, {}, None
            try:
                result = await asyncio.wait_for(self.agent.function()(client, row.agent_row()), self.timeout_s)
                reward, extras = reward_of(result)
            except asyncio.TimeoutError:
                error = f"took longer than rollout.agent.timeout_s={self.timeout_s:g}"
            except ValueError as err:
                error = str(err) if str(err).startswith("returned") else _raised(err)
            except Exception as err:  # noqa: BLE001  any failure of the agent's own code is its run's, not the worker's
                error = _raised(err)
            finally:
                await client.close()
            wall_s = time.perf_counter() - start
            trajectory = self.endpoint.close_session(session)
            if error is not None:
                failures[error] = failures.get(error, 0) + 1
            return AgentRun(trajectory, reward, extras, error, wall_s, trajectory.generate_s)

    def close(self) -> None:
        """Stop the endpoint and the loop's thread."""
        if self._loop.is_closed():
            return
        try:
            self._call(self.endpoint.stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()


def worker_agents(agent_cfg, source, engine: RolloutEngine, temperature: float, max_new_tokens: int) -> AgentRollout:
    """A rollout worker's agent runtime: source.agent (the agent function) over engine, sampling at temperature,
    max_new_tokens per completion where an agent asks for none, source.response_length response tokens per run
    (data.max_response_length); agent_cfg: the config's rollout.agent section. A per-run token where the endpoint
    binds another address than a loopback one."""
    settings = SamplingSettings(temperature, (int(source.eos_token),), int(max_new_tokens))
    limits = AgentLimits(agent_cfg.max_turns, int(source.response_length), agent_cfg.max_prompt_length)
    token = None if is_loopback(agent_cfg.host) else new_token()
    return AgentRollout(
        source.agent,
        engine,
        source.tokenizer,
        settings,
        limits,
        agent_cfg.max_concurrency,
        agent_cfg.timeout_s,
        host=agent_cfg.host,
        token=token,
    )


def _raised(err: BaseException) -> str:
    return f"raised {type(err).__name__}: {one_line(err, None)[:200]}"


def agent_groups(runs: list[AgentRun], n: int, prompt_ids: Sequence, version: int, pad_token: int) -> list[Group]:
    """One Group per row of runs (n runs each, row-major). prompt_ids: each row's prompt as the data source rendered
    it, used only for a row none of whose runs made a completion. version: the ticket's start version (the group's,
    what staleness counts; per-token versions in token_versions).

    The group's prompt is the longest common prefix of its runs' first prompts (an agent that renders its prompt the
    same way every run: all of it); what a run's prompt has beyond it starts its response, masked."""
    groups = []
    for g in range(len(runs) // n):
        chunk = runs[g * n : (g + 1) * n]
        started = [r.trajectory.prompt_ids for r in chunk if r.trajectory.prompt_ids]
        prompt = _common_prefix(started) if started else [int(t) for t in prompt_ids[g]]
        rows = [_response_row(r.trajectory, len(prompt), version) for r in chunk]
        width = max(1, max(len(ids) for ids, *_ in rows))  # one masked pad where no run sampled anything
        responses = torch.full((n, width), pad_token, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.bool)
        behav_logp = torch.zeros((n, width), dtype=torch.float32)
        versions = torch.full((n, width), version, dtype=torch.long)
        for i, (ids, loss_mask, logp, token_versions) in enumerate(rows):
            k = len(ids)
            responses[i, :k] = torch.tensor(ids, dtype=torch.long)
            mask[i, :k] = torch.tensor(loss_mask, dtype=torch.bool)
            behav_logp[i, :k] = torch.tensor(logp, dtype=torch.float32)
            versions[i, :k] = torch.tensor(token_versions, dtype=torch.long)
            versions[i, k:] = token_versions[-1] if k else version
        stats = [r.stats() for r in chunk]
        keys = sorted({key for s in stats for key in s})
        extra = {key: torch.tensor([s.get(key, float("nan")) for s in stats], dtype=torch.float32) for key in keys}
        groups.append(
            Group(
                torch.tensor(prompt, dtype=torch.long),
                responses,
                mask,
                behav_logp,
                torch.tensor([r.reward for r in chunk], dtype=torch.float32),
                version,
                reward_extra=extra,
                token_versions=versions,
            )
        )
    return groups


def _common_prefix(sequences: list[list[int]]) -> list[int]:
    first = sequences[0]
    length = len(first)
    for other in sequences[1:]:
        length = min(length, len(other))
        for i in range(length):
            if other[i] != first[i]:
                length = i
                break
    return list(first[:length])


def _response_row(t: Trajectory, prompt_length: int, version: int):
    """(ids, loss mask, behav log-probs, versions) of a run's response after the group's prompt: the rest of its own
    prompt (masked, at the version of its first sampled token), then its trajectory's response."""
    head = t.prompt_ids[prompt_length:]
    first_version = t.versions[0] if t.versions else version
    return (
        head + t.response_ids,
        [0] * len(head) + t.loss_mask,
        [0.0] * len(head) + t.behav_logp,
        [first_version] * len(head) + t.versions,
    )
