"""Rollout workers: sample n responses per prompt with the behavior policy and score them.

RolloutGenerator is the plain logic (a rollout engine, rollout.name's, that samples; a prompt sampler; scoring). It
loads weights (Weights: however they reached its process), is seeded per ticket and generates; the loop that gets it
tickets and hands its groups back is buffer_client.run_ticket, over whichever way the worker reaches the replay buffer
(a Ray actor: ray_worker.py; a local process: process.py; the trainer's own process: buffer_client.InProcessClient).
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass

import numpy as np
import torch

from dppo.config.sections.rollout import AgentSection
from dppo.data.source import PromptSource
from dppo.hostmem import bound_retention, keep_freed_host_memory
from dppo.batch import Group
from dppo.workers.rollout.agent.runner import agent_groups, worker_agents
from dppo.workers.rollout.engine_config import make_engine
from dppo.workers.rollout.engines import EngineSettings, Refresh, RolloutEngine, WeightSync
from dppo.lora import LoraPublish
from dppo.workers.rollout.lora_sync import LoraLoad, MergedPrints, load_lora
from dppo.workers.rollout.replay_buffer import Published, SyncCost
from dppo.workers.weight_fingerprint import prints_of
from dppo.workers.sync_check import WeightFingerprint, verify

# Tags the SeedSequence of a ticket's streams apart from every other use of trainer.seed.
_TICKET_STREAM = 0x71C4E7


@dataclass(frozen=True)
class RolloutWorkerSettings:
    """What a rollout worker reads of a run: its engine's settings and its sampling, resolved once by the driver
    (dppo.trainer.rollout.settings.worker_settings) and handed to each worker as they are. A worker never sees the
    config itself."""

    engine_name: str  # rollout.name: a builtin engine, or a RolloutEngine class path of the user's own
    engine: EngineSettings  # what the engine is built from, for the run's prompts
    seed: int  # trainer.seed: each ticket's prompts and samples are drawn from it and the ticket's grant index
    n: int  # rollout.n: responses per prompt
    temperature: float  # rollout.temperature (an agent's sampling; the engine's own is engine.temperature)
    max_new_tokens: int  # rollout.max_new_tokens, else the source's response length: an agent turn's budget
    groups_per_batch: int  # rollout.groups_per_batch: the groups a worker asks for in one ticket (separate_async)
    num_threads: int  # rollout.num_threads: torch's threads in a worker's own process
    partial_rollout: bool  # rollout.partial_rollout: generate() takes a refresh (mid-ticket weights)
    verify_sync: bool  # rollout.verify_sync: each load checked against the publish's fingerprint
    greedy_baseline: bool  # algorithm.adv_estimator scores a greedy response to each prompt as its baseline (ReMax)
    agent: AgentSection  # rollout.agent: the agents' runtime, where the source runs an agent (source.agent)
    step_bytes: int  # generation_step_bytes: what one generate() call allocates and frees again, its largest part


class Weights(abc.ABC):
    """Published weights as a worker's buffer client resolved them for its process (Published.weights there): a state
    dict (in shared memory, or the trainer's own copy), or Ray's object-store references."""

    @abc.abstractmethod
    def load_into(self, engine: RolloutEngine, holds: str | None) -> tuple[WeightSync, str | None]:
        """Load them into engine, which holds the publish of id `holds` (None: none, or weights of unknown origin):
        (what the load cost, the id of the publish the engine holds now; None where these weights have none)."""


class StateDictWeights(Weights):
    """A state dict, loaded whole."""

    def __init__(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.state_dict = state_dict

    def load_into(self, engine: RolloutEngine, holds: str | None) -> tuple[WeightSync, str | None]:
        if isinstance(self.state_dict, LoraPublish):  # model.lora_rank: the base once, then the adapter
            return load_lora(engine, self.state_dict, holds)
        return engine.load_weights(self.state_dict), None


def ticket_seeds(seed: int, first: int) -> tuple[int, int]:
    """(prompt seed, sample seed) of the ticket whose first group has grant index `first`, in a run of trainer.seed
    `seed`: what it draws its prompts and its samples from."""
    prompt_seed, sample_seed = np.random.SeedSequence([seed, _TICKET_STREAM, first]).generate_state(2)
    return int(prompt_seed), int(sample_seed)


class RolloutGenerator:
    """One worker's rollout engine, prompt sampler and sampling state; generate() returns scored groups."""

    def __init__(
        self,
        settings: RolloutWorkerSettings,
        source: PromptSource,
        model_config,
        worker_index: int,
        device: str | torch.device = "cpu",
    ):
        """settings: the driver's RolloutWorkerSettings of the run. source: the trainer's PromptSource object, never
        rebuilt here: a worker process has only the built-in tasks registered, not one the driver added with
        register_task, and need not see the data files. model_config: the trainer model's transformers config; the
        weights arrive with the first ticket. device: where the model copy and the sampling loop run (the groups
        come back on the host)."""
        self.source = source
        self.worker_index = worker_index
        self.engine: RolloutEngine = make_engine(settings.engine_name, settings.engine, model_config, device)
        self.seed = settings.seed
        self.prompts = source.sampler([self.seed, _TICKET_STREAM])  # positioned per ticket
        self.n = settings.n
        self.partial = settings.partial_rollout  # generate() takes a refresh (mid-ticket weights)
        self.greedy_baseline = settings.greedy_baseline  # ReMax
        self.version = -1  # no weights loaded yet
        self.last_sync: WeightSync | None = None  # what the latest load cost
        self.loaded_publish: str | None = None  # id of the publish the engine holds (None: none known)
        self.verify_sync = settings.verify_sync  # check each load against the publish's fingerprint
        self._merged_prints = MergedPrints()  # a LoRA run's: the base's prints, taken once
        # rollout.agent: the agents' runtime (an endpoint and its threads), started at the first ticket (after a fork)
        self._agent_cfg = settings.agent if getattr(source, "agent", None) is not None else None
        self._agents = None
        self._max_new_tokens = settings.max_new_tokens
        self._temperature = settings.temperature

    def seed_ticket(self, first: int) -> None:
        """Draw the next groups' prompts and samples from (trainer.seed, first), the grant index of the ticket's
        first group: what a ticket generates depends on the seed, its grant index and the weights only, not on
        the worker or the moment (a ticket granted again after its worker died; a resumed run)."""
        prompt_seed, sample_seed = ticket_seeds(self.seed, first)
        self.prompts.start_ticket(first, prompt_seed)
        self.engine.seed(sample_seed)

    def load(self, published: Published) -> SyncCost | None:
        """Load a publish whose weights the worker's buffer client resolved (Weights): what the run's metrics get of
        it (reported). Its fingerprint, where it has one, is checked against what the engine holds afterwards
        (check_load)."""
        holds, self.loaded_publish = self.loaded_publish, None  # known again only once the load has succeeded
        sync, self.loaded_publish = published.weights.load_into(self.engine, holds)
        self.last_sync = self.check_load(sync, published.fingerprint, published.version)
        if isinstance(self.last_sync, LoraLoad):
            self.last_sync.release()  # the merge's tensors (every target's weight): checked, not kept
        self.version = published.version
        return self.reported()

    def load_weights(
        self, state_dict: dict[str, torch.Tensor], version: int, expected: WeightFingerprint | None = None
    ) -> SyncCost | None:
        """load of a state dict as `version`, with the publish's fingerprint `expected` (None: not checked)."""
        return self.load(Published(version, StateDictWeights(state_dict), expected))

    def reported(self) -> SyncCost | None:
        """What the run's metrics get of the latest load: its cost where the engine reports its loads (the vllm
        engine; the hf engine's is a load_state_dict into its own copy), and the check's seconds with any engine
        (rollout.verify_sync: timing_s/weight_sync_verify); None where neither."""
        # a LoRA load is reported with any engine: its bytes are what LoRA saves (rollout/weight_sync_bytes)
        reported = self.engine.reports_sync or isinstance(self.last_sync, LoraLoad)
        return SyncCost.of(self.last_sync, load_reported=reported)

    def check_load(self, sync: WeightSync, expected: WeightFingerprint | None, version: int) -> WeightSync:
        """rollout.verify_sync: read back what the engine holds after loading `version` and compare it with the
        fingerprint the trainer took of what it published (expected; None: the publish was not fingerprinted).
        WeightSyncMismatchError naming the first tensor that differs (the worker is then restarted: its engine's
        weights are not the policy its groups would be tagged with); sync with the check's seconds otherwise."""
        if expected is None or not self.verify_sync:
            return sync
        start = time.perf_counter()
        try:
            if isinstance(sync, LoraLoad):
                # the adapter that arrived is the one the trainer published (expected: its adapter's fingerprint),
                # and the engine holds the merge computed from it
                # (the whole of it: every tensor the engine holds, whether this load wrote it or not)
                adapter = prints_of(sync.adapter, getattr(torch, expected.dtype))
                verify(expected, adapter, version, whose="the received adapter's")
                merged = self._merged_prints.of(sync, getattr(torch, expected.dtype))
                verify(merged, self.engine.held_prints(merged), version)
            else:
                verify(expected, self.engine.held_prints(expected), version)
        except Exception:
            self.loaded_publish = None  # whatever the engine holds now, it is not that publish
            raise
        sync.verify_seconds = time.perf_counter() - start
        return sync

    @torch.no_grad()
    def generate(self, num_groups: int, refresh: Refresh | None = None) -> list[Group]:
        """num_groups fresh prompts, n sampled responses each, scored and tagged with the version they start with.
        refresh: where rollout.partial_rollout is on, the engine's look for newer weights once per decode chunk (it
        loads them through this generator); the groups then carry each token's version (token_versions)."""
        if self.version < 0:
            raise RuntimeError("RolloutGenerator.generate called before any weights were loaded")
        source, n, start_version = self.source, self.n, self.version
        drawn = self.prompts.sample(num_groups)  # G prompts
        if self._agent_cfg is not None:
            return self.generate_with_agents(drawn, refresh if self.partial else None)
        prompts = drawn.repeat(n)  # G n rows, prompt-major
        refresh = refresh if self.partial else None
        # ReMax's baseline before the samples: under rollout.partial_rollout they may load newer weights, and the
        # baseline is the start version's greedy response (it draws nothing, so the samples stay the same)
        baselines = self.greedy_baseline_scores(drawn) if self.greedy_baseline else [float("nan")] * num_groups
        samples = self.engine.sample(list(drawn.token_ids), n, start_version, refresh)  # (G n, R) each
        responses, mask, behav_logp = samples.responses, samples.response_mask, samples.behav_logp
        versions = samples.versions  # (G n, R); kept only where a response spans versions (else the group's own)
        if versions is None or bool((versions == start_version).all()):
            versions = None
        scored = source.score(prompts, responses.numpy(), mask.numpy())
        scores = torch.from_numpy(scored.scores)
        extra = {key: torch.from_numpy(values) for key, values in scored.extra.items()}
        return [
            Group(
                torch.as_tensor(np.asarray(drawn.token_ids[g]), dtype=torch.long),
                responses[i : i + n],
                mask[i : i + n],
                behav_logp[i : i + n],
                scores[i : i + n],
                start_version,
                reward_extra={key: values[i : i + n] for key, values in extra.items()},
                baseline_score=baselines[g],
                token_versions=None if versions is None else versions[i : i + n],
            )
            for g, i in enumerate(range(0, responses.shape[0], n))
        ]

    def generate_with_agents(self, drawn, refresh: Refresh | None) -> list[Group]:
        """rollout.agent: the agent run n times on each drawn row, through this worker's endpoint; one group a row."""
        if self._agents is None:
            self._agents = worker_agents(
                self._agent_cfg, self.source, self.engine, self._temperature, self._max_new_tokens
            )
        runs = self._agents.run(drawn.meta, self.n, self.version, refresh)
        return agent_groups(runs, self.n, drawn.token_ids, self.version, self.source.pad_token)

    def close(self) -> None:
        """Stop the agents' runtime, if it started (the engine is closed by whoever owns the worker)."""
        if self._agents is not None:
            self._agents.close()
            self._agents = None

    def greedy_baseline_scores(self, prompts) -> list[float]:
        """The score of one greedy response to each of prompts (G rows): ReMax's baseline, decoded with the weights the
        group starts with (before its samples, which rollout.partial_rollout may finish under newer ones) and not
        trained on (no random draw, so the ticket's samples are those of any other estimator)."""
        responses, mask = self.engine.greedy(list(prompts.token_ids))  # (G, R) each
        return self.source.score(prompts, responses.numpy(), mask.numpy()).scores.astype(float).tolist()


def generation_step_bytes(rollout, micro_batch_size: int, vocab_size: int) -> int:
    """About what one generate() call allocates and frees again, its largest part: fp32 logits over the vocab (and
    their log-softmax) of a decode step's sequences or of a scoring micro-batch's positions (rollout: the config's
    rollout section; micro_batch_size: actor.micro_batch_size, the scoring pass's)."""
    seqs = rollout.groups_per_batch * rollout.n
    scored_rows = min(micro_batch_size, seqs) * ((rollout.max_new_tokens or 64) + 1)
    return 2 * 4 * vocab_size * max(seqs, scored_rows)


def worker_generator(
    settings: RolloutWorkerSettings,
    source: PromptSource,
    model_config,
    worker_index: int,
    device: str | torch.device = "cpu",
) -> RolloutGenerator:
    """The RolloutGenerator of a rollout worker's own process (a Ray actor's, a local worker process's), the process
    set up for generating first: generation's freed KV caches stay mapped (keep_freed_host_memory), within a bound
    of one generate() call's largest part (settings.step_bytes), and rollout.num_threads threads."""
    keep_freed_host_memory()
    torch.set_num_threads(settings.num_threads)
    generator = RolloutGenerator(settings, source, model_config, worker_index, device)
    bound_retention(settings.step_bytes)
    return generator
