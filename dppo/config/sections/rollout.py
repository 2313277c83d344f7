"""The config schema's rollout.* and replay.*: the rollout workers, their engine and weight sync, and the replay buffer
between them and the trainer. One dataclass per section, a docstring per field, each section's own rules in its
__post_init__ (dppo.config.schema assembles the whole config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


from dppo.config.checks import (
    ConfigError,
    check_numbers,
    nonnegative,
    one_of,
    positive,
    require,
    shown,
)
from dppo.config.choices import (
    DTYPES,
    ENGINE_CLASS_PATH,
    OFF_POLICY_STRATEGIES,
    PRECISION_AUTO,
    ROLLOUT_ENGINES,
    WEIGHT_SYNC_MODES,
)


@dataclass
class AgentSection:
    """rollout.agent: multi-turn agents with tools (docs/agents.md). An agent is an async Python function named like
    custom_reward_function, `async def agent(client, row) -> float | dict`, run rollout.n times on each prompt row;
    client is an openai.AsyncOpenAI pointed at the rollout worker's own endpoint over its engine."""

    path: Optional[str] = None
    """Python file that defines the agent function; null: no agents (one prompt, one response, scored by the reward
    function)."""

    name: str = "agent"
    """The agent function's name in rollout.agent.path."""

    max_concurrency: int = 64
    """Agent runs in flight at once on each rollout worker (their completions batched together: vLLM's continuous
    batching, the hf engine's next batch)."""

    max_turns: int = 8
    """Completions one agent run may ask for; the next one is refused (the agent sees an error naming this key)."""

    timeout_s: float = 300.0
    """Wall time one agent run may take; past it the run gets reward 0 and counts one agent/errors."""

    max_prompt_length: int = 1024
    """Tokens of an agent run's first prompt at most (its own system prompt and examples included, after the chat
    template); a longer one is refused. The whole trajectory after it holds data.max_response_length tokens at most
    (sampled, tool and template tokens): an engine sizes its cache for both (vLLM's KV cache)."""

    host: str = "127.0.0.1"
    """Address the agents' endpoint binds. Another than a loopback address makes it reachable from other machines:
    then every request must carry the run's token (the clients handed to agents carry it)."""

    def __post_init__(self) -> None:
        check_numbers(self, "rollout.agent")
        positive("rollout.agent.max_concurrency", self.max_concurrency)
        positive("rollout.agent.max_turns", self.max_turns)
        positive("rollout.agent.timeout_s", self.timeout_s)
        positive("rollout.agent.max_prompt_length", self.max_prompt_length)
        require(
            isinstance(self.name, str) and self.name.isidentifier(),
            "rollout.agent.name",
            self.name,
            "the name of a function in rollout.agent.path",
        )
        require(bool(self.host), "rollout.agent.host", self.host, "an address to bind, such as 127.0.0.1")

    @property
    def enabled(self) -> bool:
        return self.path is not None


@dataclass
class RolloutConfig:
    num_workers: int = 1
    """Rollout worker actors, each with its own copy of the model: CPU processes, or one per GPU of the rollout's
    pool (rollout.n_gpus_per_node)."""

    n: int = 8
    """Responses sampled per prompt (the group size of GRPO/RLOO)."""

    temperature: float = 1.0
    """Sampling temperature (the log-probs of the loss use the same temperature)."""

    max_new_tokens: Optional[int] = None
    """Response length limit; null: data.max_response_length for text data, the task's answer length for a task."""

    groups_per_batch: int = 32
    """Prompt groups a worker generates per batch; weights are reloaded between batches."""

    num_threads: int = 1
    """torch intra-op threads of each rollout worker."""

    max_restarts: int = 3
    """Times each rollout worker is restarted after its process dies (its outstanding groups are generated anew);
    one more death ends the run, after a checkpoint of the trainer's state."""

    nnodes: int = 1
    """Nodes of the rollout's own GPU pool (verl's key); above 1 it needs rollout.n_gpus_per_node > 0 (CPU workers
    are spread over the nodes by Ray)."""

    n_gpus_per_node: int = 0
    """GPUs per node of the rollout's own pool, apart from the actor's (verl's key): one GPU per rollout worker, in
    a placement-group bundle of its own, so rollout.num_workers must be rollout.nnodes x rollout.n_gpus_per_node.
    0: no GPUs; rollout.num_workers CPU processes with rollout.num_threads threads each."""

    name: str = "hf"
    """Rollout engine (verl's key): hf (dppo's sampler over the transformers model), vllm (vllm.LLM in each
    rollout worker, its weights synced in place each cycle; needs `make vllm` and a run from .venv-vllm), or
    package.module:Class, a RolloutEngine subclass of your own (docs/rollout_engines.md, "Your own engine")."""

    weight_sync: str = "full"
    """How new weights reach a vllm engine each cycle: full (every tensor) or delta (only the elements whose value
    in the engine's dtype changed since the last sync; bitwise the same engine weights)."""

    verify_sync: bool = True
    """Check every weight load into a rollout engine: the trainer fingerprints what it publishes (exact per-tensor
    checksums in the engine's dtype), the worker reads back what its engine holds after the load and compares; a
    difference names the first tensor that differs and restarts the worker (rollout.max_restarts) or ends the run.
    Its time: timing_s/weight_sync_verify (either engine)."""

    dtype: Optional[str] = None
    """The rollout engine's dtype (float32, bfloat16, float16); null: model.dtype. A bfloat16 engine with an fp32
    trainer gives behavior log-probs that differ from the trainer's (algorithm.rollout_correction is for that).
    auto: bfloat16 where the engine's device computes it faster (a GPU with bf16: rollout.n_gpus_per_node > 0, or
    vllm on a machine with one; else this CPU, by the timed matmul of actor.mixed_precision=auto), else model.dtype;
    decided once before the run (dppo.launch.precision) and logged in one line."""

    enforce_eager: Optional[bool] = None
    """vllm engine (verl's key): true runs the model eagerly; false lets vLLM compile it (torch.compile, and CUDA
    graphs on a GPU). null: eager on the CPU, where compiling saved 15-20% of the work per token at 42M on 128
    rows and nothing on 512, and adds 40-65 s to every engine's start, a restarted worker's included; compiled on a
    GPU, vLLM's own default there."""

    partial_rollout: bool = False
    """verl's key: when the trainer publishes a new version while a worker generates a ticket, each unfinished
    response keeps its tokens and their behavior log-probs and goes on under the new weights (hf: the weights are
    swapped between two decode steps and the prefix's KV cache rebuilt; vllm: its requests are aborted and resumed
    with prompt + tokens so far); finished ones are not touched. Every token carries the version that sampled it;
    the group keeps its start version, by which staleness is bounded (its oldest token). No effect in
    trainer.mode=sync, where nothing is published while a ticket generates. Off until measured."""

    agent: AgentSection = field(default_factory=AgentSection)

    partial_chunk: int = 16
    """rollout.partial_rollout: decode steps between two looks for newer weights (one poll each: a shared counter
    without Ray, a non-blocking look at one buffer call kept in flight with Ray). A look itself is nearly free (0.8 us
    for the counter, 2.4 us for ray.wait(timeout=0), against 18 ms for one decode step of 256 rows of the demo model
    on one CPU thread), but on Ray each answered look sends the next call to the one replay-buffer actor that every
    worker and the trainer share (about 2 ms a round trip): 16 keeps that to one call per worker per 16 decode steps,
    while a new version waits at most 16 tokens, a small part of a response of 64 tokens and more."""

    def __post_init__(self) -> None:
        check_numbers(self, "rollout")
        positive("rollout.partial_chunk", self.partial_chunk)
        positive("rollout.num_workers", self.num_workers)
        require(self.n >= 2, "rollout.n", self.n, "at least 2 (group advantages need two responses)")
        positive("rollout.temperature", self.temperature)
        if self.max_new_tokens is not None:
            positive("rollout.max_new_tokens", self.max_new_tokens)
        positive("rollout.groups_per_batch", self.groups_per_batch)
        positive("rollout.num_threads", self.num_threads)
        nonnegative("rollout.max_restarts", self.max_restarts)
        positive("rollout.nnodes", self.nnodes)
        nonnegative("rollout.n_gpus_per_node", self.n_gpus_per_node)
        require(
            self.name in ROLLOUT_ENGINES or ENGINE_CLASS_PATH.fullmatch(self.name) is not None,
            "rollout.name",
            self.name,
            f"one of {', '.join(map(repr, ROLLOUT_ENGINES))}, or the class path package.module:Class of a "
            "RolloutEngine subclass of your own",
        )
        one_of("rollout.weight_sync", self.weight_sync, WEIGHT_SYNC_MODES)
        if self.dtype is not None:
            one_of("rollout.dtype", self.dtype, (*DTYPES, PRECISION_AUTO))
        self._check_pool()

    def _check_pool(self) -> None:
        """One rollout worker per GPU of the pool; a pool of several nodes only with GPUs."""
        pool = f"rollout.nnodes={self.nnodes} x rollout.n_gpus_per_node={self.n_gpus_per_node}"
        if self.n_gpus_per_node == 0:
            require(
                self.nnodes == 1,
                "rollout.nnodes",
                self.nnodes,
                "1 while rollout.n_gpus_per_node=0 (the rollout "
                "then has no GPU pool to spread over nodes: Ray spreads its CPU workers)",
            )
        elif self.num_workers != self.nnodes * self.n_gpus_per_node:
            raise ConfigError(
                f"rollout.num_workers={shown(self.num_workers)}, but the rollout's pool {pool} holds "
                f"{self.nnodes * self.n_gpus_per_node} GPUs, one per rollout worker; set "
                f"rollout.num_workers={self.nnodes * self.n_gpus_per_node}"
            )


@dataclass
class ReplayConfig:
    max_off_policy_threshold: int = 1
    """Largest staleness (trainer version - sample version) a consumed group may have. With rollout.partial_rollout
    a response may span versions: the bound applies to its oldest token (the version the group started with)."""

    max_off_policy_strategy: str = "wait"
    """wait: pause rollout so no group gets older than the threshold; nothing is dropped, with any number of
    workers (the trainer takes groups in the order they were granted, waiting for a slow worker's older ones);
    drop: workers run ahead freely, the trainer takes the oldest groups that have arrived and discards the
    ones older than the threshold (counted in replay/dropped)."""

    def __post_init__(self) -> None:
        check_numbers(self, "replay")
        nonnegative("replay.max_off_policy_threshold", self.max_off_policy_threshold)
        one_of("replay.max_off_policy_strategy", self.max_off_policy_strategy, OFF_POLICY_STRATEGIES)
