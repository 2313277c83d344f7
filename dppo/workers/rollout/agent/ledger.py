"""The token ledger: every completion of every agent run, and the one token sequence the trainer gets per run.

Sessions. Each agent run is one session (its id is in the client's base_url: http://127.0.0.1:PORT/s/<session>/v1).
Every completion the agent asks for is recorded as a TurnRecord: the request's messages (normalised) and the
assistant message returned, or for /v1/completions the prompt's ids; the prompt ids the engine was given; the
sampled ids with their behaviour log-probs and weight versions; the engine's finish reason; its parent.

Parents. A chat request continues the recorded completion whose messages + returned assistant message are the
longest prefix of its own messages (compared normalised: dppo.workers.rollout.agent.chat); its prompt is the parent's
sequence + the template's bridge (chat.py). A /v1/completions request continues the record whose prompt + sampled ids
are the longest prefix of its prompt ids; the rest of its ids is its bridge (no end token is added after a turn cut
by length there: the agent's ids are what the model sees). A request that continues none starts a
new chain (a root).

Retokenize mismatches. A chat request counts one agent/retokenize_mismatch (logged once per session, with why)
wherever assistant text is encoded instead of sampled ids taken from the ledger: it continues no completion yet
carries assistant messages (rendered anew, a new root; the session's first request excepted: assistant messages
there are the agent's own few-shot text, not sampled tokens); its parent's render does not match the parent's tokens
(rendered anew, a new root); or after its parent it carries an assistant message the session did not return (an
edited or made-up turn: encoded into the bridge, mask 0; the parent's chain is kept). It is 0 for an agent that
sends back each returned message as it got it.

The trajectory (Session.trajectory) is ONE sequence along the session's main chain: the chain (root -> ... -> leaf,
by parent links) with the most completions, the latest leaf among equals. Completions not on it (branches: an agent
that asked two continuations of one turn, a side conversation, a history re-rendered after a mismatch) are counted
in Trajectory.branches and not trained on: the trainer trains the main chain only.

    prompt_ids    the root's prompt ids
    response_ids  everything after them: each completion's sampled ids, and between two completions the next one's
                  bridge (template tokens, tool results, env or user messages; the end-of-turn token appended after
                  a turn cut by length)
    loss_mask     1 on sampled ids, 0 on everything else
    behav_logp    the engine's log-prob of each sampled id, 0.0 where loss_mask is 0
    versions      the weight version of each sampled id; a masked token takes the version of the latest sampled id
                  before it (the response starts with sampled ids, so there is always one): the version in effect
                  when the token was appended, as engines pad (dppo.workers.rollout.engines.base.Samples). Versions
                  never decrease along a chain, so masked tokens never lower the oldest version, which is what the
                  trainer's staleness counts (Trajectory.start_version).

Limits (AgentLimits, the config's rollout.agent.*). max_turns bounds the completions of a session (in flight
included); a request beyond it is refused with a 400 naming rollout.agent.max_turns. max_response_tokens bounds a
chain's response_ids: a request whose prompt already leaves fewer than its max_tokens gets max_tokens cut to what is
left; one that leaves none is refused (400, naming data.max_response_length), so a trajectory's response
never exceeds it. max_prompt_tokens bounds a chain's first prompt (400, naming rollout.agent.max_prompt_length).
"""

from __future__ import annotations

import logging
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field

from dppo.workers.rollout.agent.errors import StitchError, TokenBudgetError, TurnLimitError, UnknownSessionError

log = logging.getLogger("dppo.rollout.agent")

MAX_TURNS_KEY = "rollout.agent.max_turns"
MAX_RESPONSE_TOKENS_KEY = "data.max_response_length"
MAX_PROMPT_TOKENS_KEY = "rollout.agent.max_prompt_length"


@dataclass(frozen=True)
class AgentLimits:
    """Per agent run: completions (max_turns), response tokens of the trajectory (max_response_tokens: the config's
    data.max_response_length) and tokens of its first prompt (max_prompt_tokens: rollout.agent.max_prompt_length; an
    engine sizes its cache for a first prompt and a response of these lengths)."""

    max_turns: int
    max_response_tokens: int
    max_prompt_tokens: int = 4096

    def __post_init__(self) -> None:
        for key, value in (
            (MAX_TURNS_KEY, self.max_turns),
            (MAX_RESPONSE_TOKENS_KEY, self.max_response_tokens),
            (MAX_PROMPT_TOKENS_KEY, self.max_prompt_tokens),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{key}={value!r}: expected an int > 0")


@dataclass
class TurnRecord:
    """One completion of a session."""

    index: int  # its place in the session's records
    kind: str  # "chat" (/v1/chat/completions) or "text" (/v1/completions)
    messages: list[dict] | None  # chat: the request's messages, normalised
    output: dict | None  # chat: the assistant message returned, normalised
    prompt_ids: list[int]  # what the engine was given
    completion_ids: list[int]  # what it sampled, the stop token included
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # the engine's: "stop" or "length"
    parent: int | None  # the index of the record it continues; None: a root
    text: str  # the sampled ids' exact text without the stop token (what the template renders it as)

    @property
    def sequence_ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids


@dataclass
class Plan:
    """The prompt a request is generated from: its ids, the record it continues (None: a root) and, where it was
    rendered anew against the session's history, why (a retokenize mismatch)."""

    prompt_ids: list[int]
    parent: TurnRecord | None
    mismatch: str | None = None


@dataclass
class Trajectory:
    """One agent run as the trainer takes it (see the module docstring). An agent that made no completion gives
    turns 0 and empty lists."""

    session: str
    greedy: bool
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    behav_logp: list[float]
    versions: list[int]
    turns: int  # completions on the main chain
    branches: int  # completions not on it (not trained on)
    retokenize_mismatch: int
    tool_parse_failures: int
    finish_reason: str | None  # the main chain's last completion's ("stop" or "length"); None without one
    generate_s: float = 0.0  # wall time the session's completions took (waiting for the engine included)

    @property
    def masked_token_frac(self) -> float:
        """The part of response_ids that is not sampled (bridge, tool, env and masked end tokens)."""
        return self.loss_mask.count(0) / len(self.loss_mask) if self.loss_mask else 0.0

    @property
    def start_version(self) -> int | None:
        """The oldest weight version among the sampled ids (what staleness counts); None without any."""
        return min(self.versions) if self.versions else None


def _prefix_of(short: list, long: list) -> bool:
    return len(short) <= len(long) and long[: len(short)] == short


@dataclass
class Session:
    """One agent run's records and counters."""

    id: str
    greedy: bool
    limits: AgentLimits
    records: list[TurnRecord] = field(default_factory=list)
    in_flight: int = 0
    retokenize_mismatch: int = 0
    tool_parse_failures: int = 0
    generate_s: float = 0.0  # wall time its completions took, waiting for the engine included
    closed: bool = False
    _mismatch_logged: bool = False

    def chain(self, record: TurnRecord) -> list[TurnRecord]:
        """The records from the root to record, by parent links."""
        chain = [record]
        while chain[-1].parent is not None:
            chain.append(self.records[chain[-1].parent])
        return chain[::-1]

    def chat_parent(self, messages: list[dict]) -> TurnRecord | None:
        """The chat record whose messages + output are the longest prefix of messages (normalised), the latest among
        equals; None where none is."""
        best, best_length = None, 0
        for record in self.records:
            seen = record.messages + [record.output] if record.kind == "chat" else []
            if seen and len(seen) >= best_length and len(seen) < len(messages) and messages[: len(seen)] == seen:
                best, best_length = record, len(seen)
        return best

    def token_parent(self, prompt_ids: list[int]) -> TurnRecord | None:
        """The record whose prompt + sampled ids are the longest prefix of prompt_ids, the latest among equals."""
        best, best_length = None, 0
        for record in self.records:
            if len(record.sequence_ids) >= best_length and _prefix_of(record.sequence_ids, prompt_ids):
                best, best_length = record, len(record.sequence_ids)
        return best

    def plan_chat(self, chat, messages: list[dict], tools: list[dict] | None) -> Plan:
        """The prompt of a chat request (messages normalised), with chat a ChatFormat: its parent's sequence + the
        bridge, or rendered anew (see the module docstring)."""
        parent = self.chat_parent(messages)
        if parent is None:
            replayed = self.records and any(m["role"] == "assistant" for m in messages)
            why = "its messages continue none of this session's completions (edited history?)" if replayed else None
            return Plan(chat.encode(chat.render(messages, tools)), None, why and f"{why}: rendered anew")
        render = list(messages)
        for record in self.chain(parent):  # each recorded assistant message as its sampled text
            render[len(record.messages)] = {"role": "assistant", "content": record.text}
        ids = parent.sequence_ids + ([chat.end_token_id] if parent.finish_reason == "length" else [])
        try:
            bridge = chat.bridge(ids, render, tools)
        except StitchError as error:
            return Plan(chat.encode(chat.render(render, tools)), None, f"{error}: rendered anew")
        new = range(len(parent.messages) + 1, len(messages))
        foreign = next((i for i in new if messages[i]["role"] == "assistant"), None)
        why = None
        if foreign is not None:
            why = (
                f"messages[{foreign}] is an assistant message this session did not return (edited, or written by the "
                "agent): its text is encoded into the bridge (mask 0)"
            )
        return Plan(ids + bridge, parent, why)

    def plan_tokens(self, prompt_ids: list[int]) -> Plan:
        """The prompt of a /v1/completions request: its own ids, continuing the record they extend, if any."""
        return Plan(list(prompt_ids), self.token_parent(prompt_ids))

    def count_mismatch(self, why: str) -> None:
        self.retokenize_mismatch += 1
        if not self._mismatch_logged:
            self._mismatch_logged = True
            log.warning(
                "agent session %s, request %d re-encodes assistant text instead of the sampled tokens: %s; counted "
                "in agent/retokenize_mismatch (logged once per session)",
                self.id,
                len(self.records) + self.in_flight,
                why,
            )

    @contextmanager
    def turn(self):
        """Count a request as in flight while the block runs; refuse it beyond max_turns (TurnLimitError)."""
        made = len(self.records) + self.in_flight
        if made >= self.limits.max_turns:
            raise TurnLimitError(
                f"this agent run already made {made} completions, the limit {MAX_TURNS_KEY}={self.limits.max_turns}",
                "messages",
            )
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    def max_tokens(self, plan: Plan, asked: int) -> int:
        """asked, cut to the response tokens the plan's chain has left (TokenBudgetError where none are)."""
        root = self.chain(plan.parent)[0].prompt_ids if plan.parent is not None else plan.prompt_ids
        if len(root) > self.limits.max_prompt_tokens:
            raise TokenBudgetError(
                f"this agent run's first prompt is {len(root)} tokens after the chat template, more than "
                f"{MAX_PROMPT_TOKENS_KEY}={self.limits.max_prompt_tokens}",
                "messages",
            )
        used = len(plan.prompt_ids) - len(root)
        left = self.limits.max_response_tokens - used
        if left <= 0:
            raise TokenBudgetError(
                f"this agent run's trajectory already holds {used} response tokens (sampled, tool and env tokens), "
                f"the limit {MAX_RESPONSE_TOKENS_KEY}={self.limits.max_response_tokens}: no tokens left to generate",
                "max_tokens",
            )
        return min(asked, left)

    def record(self, record: TurnRecord) -> None:
        record.index = len(self.records)
        self.records.append(record)

    def _main_leaf(self) -> TurnRecord | None:
        """The leaf of the chain with the most completions, the latest among equals."""
        depth: list[int] = []
        for record in self.records:  # a parent is always recorded before its children
            depth.append(1 if record.parent is None else depth[record.parent] + 1)
        best = max(range(len(depth)), key=lambda i: (depth[i], i), default=None)
        return None if best is None else self.records[best]

    def trajectory(self) -> Trajectory:
        """The session's main chain as one sequence (see the module docstring)."""
        leaf = self._main_leaf()
        chain = [] if leaf is None else self.chain(leaf)
        response, mask, logp, versions = [], [], [], []
        end = len(chain[0].prompt_ids) if chain else 0
        for record in chain:
            sequence = chain[0].prompt_ids + response
            assert _prefix_of(sequence, record.prompt_ids), "a record's prompt continues its parent's sequence"
            bridge = record.prompt_ids[end:]
            response += bridge + record.completion_ids
            mask += [0] * len(bridge) + [1] * len(record.completion_ids)
            logp += [0.0] * len(bridge) + list(record.logprobs)
            versions += [versions[-1] if versions else record.versions[0]] * len(bridge) + list(record.versions)
            end = len(record.prompt_ids) + len(record.completion_ids)
        return Trajectory(
            session=self.id,
            greedy=self.greedy,
            prompt_ids=list(chain[0].prompt_ids) if chain else [],
            response_ids=response,
            loss_mask=mask,
            behav_logp=logp,
            versions=versions,
            turns=len(chain),
            branches=len(self.records) - len(chain),
            retokenize_mismatch=self.retokenize_mismatch,
            tool_parse_failures=self.tool_parse_failures,
            finish_reason=chain[-1].finish_reason if chain else None,
            generate_s=self.generate_s,
        )


class Ledger:
    """The sessions of one endpoint."""

    def __init__(self, limits: AgentLimits):
        self.limits = limits
        self.sessions: dict[str, Session] = {}

    def new_session(self, greedy: bool = False) -> str:
        session_id = uuid.uuid4().hex
        self.sessions[session_id] = Session(session_id, greedy, self.limits)
        return session_id

    def session(self, session_id: str) -> Session:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise UnknownSessionError(f"no agent session {session_id!r} (never created, or closed)", None) from None

    def close(self, session_id: str) -> Trajectory:
        """The session's trajectory; the session is forgotten (a request of it still generating gets a 409)."""
        session = self.session(session_id)
        session.closed = True
        del self.sessions[session_id]
        return session.trajectory()
