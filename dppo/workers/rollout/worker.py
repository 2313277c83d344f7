"""Rollout workers: sample n responses per prompt with the behavior policy and score them.

RolloutGenerator is the plain logic (a rollout engine, rollout.name's, that samples; a prompt sampler; scoring); the Ray actor
RolloutWorkerActor only moves data: at each generation boundary it asks the replay buffer for a ticket,
loads the newer weights the ticket carries (one object-store get: the full weights, or with
rollout.weight_sync=delta only what changed since the weights it holds), generates and hands the groups back.
A worker that Ray gave a GPU (a bundle of the rollout's pool, rollout.n_gpus_per_node) generates on it.

rollout.partial_rollout: while it generates, the actor keeps one call of the buffer's `newer` in flight and looks at it
without waiting once per decode chunk (the engine's refresh); where the trainer has published a newer version it
loads it mid-ticket and the unfinished responses go on under it. The ticket stays the one granted at its start: its
groups keep their start version (staleness counts their oldest token) and the wait budget is unchanged.
"""

from __future__ import annotations

import os
import time

import numpy as np
import ray
import torch

from dppo.algo import GREEDY_BASELINE_ESTIMATORS
from dppo.data.source import PromptSource
from dppo.hostmem import bound_retention, keep_freed_host_memory
from dppo.models import as_state_dict
from dppo.batch import Group
from dppo.workers.rollout.agent.runner import agent_groups, worker_agents
from dppo.workers.rollout.engine_config import make_engine
from dppo.workers.rollout.engines import Refresh, RolloutEngine, WeightSync
from dppo.workers.rollout.replay_buffer import StoredGroup, SyncCost
from dppo.workers.sync_check import WeightFingerprint, verify

# Tags the SeedSequence of a ticket's streams apart from every other use of trainer.seed.
_TICKET_STREAM = 0x71C4E7


def worker_device(worker_index: int, gpu_ids: list, cuda_available: bool) -> torch.device:
    """The device of rollout worker worker_index, which Ray gave gpu_ids (ray.get_gpu_ids()): cuda:0 with a GPU
    (Ray's CUDA_VISIBLE_DEVICES shows the process its own GPUs only), the CPU without. RuntimeError if Ray gave it
    GPUs that this process's torch cannot use, rather than generating on the CPU unnoticed."""
    if not gpu_ids:
        return torch.device("cpu")
    if not cuda_available:
        raise RuntimeError(
            f"rollout worker {worker_index} was given GPU(s) {[str(g) for g in gpu_ids]} by Ray, but "
            f"torch.cuda.is_available() is False in its process (torch {torch.__version__}, "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
        )
    return torch.device("cuda", 0)


def load_published(engine: RolloutEngine, published: list, holds: str | None) -> tuple[WeightSync, str]:
    """Load a publish into engine, which holds the publish of id `holds` (None: none, or weights of unknown origin):
    only the delta where it starts from `holds`, else the full weights. (what it cost, the id the engine holds now)."""
    full_ref, delta = published[0], (published[1] if len(published) > 1 else None)
    if delta is not None and holds is not None and delta.base == holds and engine.accepts_delta:
        sync = engine.load_delta(ray.get(delta.ref))
    else:
        # SharedWeights: views of the object store's copy, loaded in place into the engine's model and dropped when
        # this returns (no second copy of the weights in this process); a plain state dict from a delta publisher
        sync = engine.load_weights(as_state_dict(ray.get(full_ref)))
    return sync, full_ref.hex()


class RolloutGenerator:
    """One worker's rollout engine, prompt sampler and sampling state; generate() returns scored groups."""

    def __init__(self, cfg, source: PromptSource, model_config, worker_index: int, device: str | torch.device = "cpu"):
        """source: the trainer's PromptSource object, never rebuilt from the config here: a worker process has only
        the built-in tasks registered, not one the driver added with register_task, and need not see the data
        files. model_config: the trainer model's transformers config; the weights arrive with the first ticket.
        device: where the model copy and the sampling loop run (the groups come back on the host)."""
        self.source = source
        self.worker_index = worker_index
        self.engine: RolloutEngine = make_engine(cfg, source, model_config, torch.device(device))  # rollout.name's
        self.seed = cfg.trainer.seed
        self.prompts = source.sampler([self.seed, _TICKET_STREAM])  # positioned per ticket
        self.n = cfg.rollout.n
        self.partial = cfg.rollout.partial_rollout  # generate() takes a refresh (mid-ticket weights)
        self.greedy_baseline = cfg.algorithm.adv_estimator in GREEDY_BASELINE_ESTIMATORS  # ReMax
        self.version = -1  # no weights loaded yet
        self.last_sync: WeightSync | None = None  # what the latest load_weights cost
        self.loaded_publish: str | None = None  # id of the Ray publish the engine holds (None: not one)
        self.verify_sync = cfg.rollout.verify_sync  # check each load against the publish's fingerprint
        # rollout.agent: the agents' runtime (an endpoint and its threads), started at the first ticket (after a fork)
        self._agent_cfg = cfg.rollout.agent if getattr(source, "agent", None) is not None else None
        self._agents = None
        self._max_new_tokens = cfg.rollout.max_new_tokens or source.response_length
        self._temperature = cfg.rollout.temperature

    def seed_ticket(self, first: int) -> None:
        """Draw the next groups' prompts and samples from (trainer.seed, first), the grant index of the ticket's
        first group: what a ticket generates depends on the seed, its grant index and the weights only, not on
        the worker or the moment (a ticket granted again after its worker died; a resumed run)."""
        prompt_seed, sample_seed = np.random.SeedSequence([self.seed, _TICKET_STREAM, first]).generate_state(2)
        self.prompts.start_ticket(first, int(prompt_seed))
        self.engine.seed(int(sample_seed))

    def load_weights(
        self, state_dict: dict[str, torch.Tensor], version: int, expected: WeightFingerprint | None = None
    ) -> SyncCost | None:
        """Load the weights of `version`; what the run's metrics get of it (reported). expected: the publish's
        fingerprint, checked against what the engine holds afterwards (check_load)."""
        self.loaded_publish = None
        self.last_sync = self.check_load(self.engine.load_weights(state_dict), expected, version)
        self.version = version
        return self.reported()

    def load_published(
        self, published: list, version: int, expected: WeightFingerprint | None = None
    ) -> SyncCost | None:
        """Load `version` from what the trainer published into Ray's object store: [ObjectRef of the full weights],
        and with rollout.weight_sync=delta a PublishedDelta against its previous publish. Only the delta is read
        when the engine holds exactly that previous publish (else the full weights: a first load, a restarted
        worker, one that skipped a version). expected: as load_weights'."""
        sync, self.loaded_publish = load_published(self.engine, published, self.loaded_publish)
        self.last_sync = self.check_load(sync, expected, version)
        self.version = version
        return self.reported()

    def reported(self) -> SyncCost | None:
        """What the run's metrics get of the latest load: its cost where the engine reports its loads (the vllm
        engine; the hf engine's is a load_state_dict into its own copy), and the check's seconds with any engine
        (rollout.verify_sync: timing_s/weight_sync_verify); None where neither."""
        return SyncCost.of(self.last_sync, load_reported=self.engine.reports_sync)

    def check_load(self, sync: WeightSync, expected: WeightFingerprint | None, version: int) -> WeightSync:
        """rollout.verify_sync: read back what the engine holds after loading `version` and compare it with the
        fingerprint the trainer took of what it published (expected; None: the publish was not fingerprinted).
        WeightSyncMismatchError naming the first tensor that differs (the worker is then restarted: its engine's
        weights are not the policy its groups would be tagged with); sync with the check's seconds otherwise."""
        if expected is None or not self.verify_sync:
            return sync
        start = time.perf_counter()
        try:
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


class RolloutWorkerActor:
    """Ray actor: generate batches of groups between weight reloads until the replay buffer closes."""

    def __init__(self, cfg, source: PromptSource, model_config, worker_index: int, buffer, holder: int):
        """holder: this incarnation's id at the replay buffer (a restarted worker gets a new one)."""
        keep_freed_host_memory()  # this actor's own process: generation's freed KV caches stay mapped
        torch.set_num_threads(cfg.rollout.num_threads)
        device = worker_device(worker_index, ray.get_gpu_ids(), torch.cuda.is_available())
        self.core = RolloutGenerator(cfg, source, model_config, worker_index, device)
        bound_retention(generation_step_bytes(cfg.rollout, cfg.actor.micro_batch_size, model_config.vocab_size))
        self.buffer = buffer
        self.holder = holder
        self.groups_per_batch = cfg.rollout.groups_per_batch
        self._poll = None  # rollout.partial_rollout: the buffer's `newer` call in flight (an ObjectRef), or None
        self._sync: SyncCost | None = None  # what the metrics get of the ticket's latest weight load

    def step(self, num_groups: int) -> int:
        """One generation boundary: wait for a ticket, load newer weights, generate; groups made (0: stopped)."""
        ticket = ray.get(self.buffer.acquire.remote(self.core.version, num_groups, self.holder))
        if ticket.stop:
            return 0
        self._sync = None
        if ticket.weights is not None:
            self._sync = self.core.load_published(ticket.weights, ticket.version, ticket.fingerprint)
        self.core.seed_ticket(ticket.first)
        self._poll = None
        groups = self.core.generate(ticket.num_groups, self._refresh)
        # torch-free forms: the buffer's process does not import torch (replay_buffer.py)
        ray.get(self.buffer.put.remote([StoredGroup.of(g) for g in groups], ticket.first, self.holder, self._sync))
        return len(groups)

    def _refresh(self):
        """rollout.partial_rollout's look for newer weights, once per decode chunk: one call of the buffer's `newer`
        kept in flight, looked at without waiting (ray.wait, timeout 0); a loader of the newer publish, or None."""
        if self._poll is None or not ray.wait([self._poll], timeout=0)[0]:
            if self._poll is None:
                self._poll = self.buffer.newer.remote(self.core.version)
            return None
        found, self._poll = ray.get(self._poll), None
        if found is None:
            return None
        version, published, fingerprint = found

        def load() -> int:
            self._sync = self.core.load_published(published, version, fingerprint)
            return version

        return load

    def run(self) -> None:
        """Separate-async mode: generate continuously until the buffer is closed."""
        while self.step(self.groups_per_batch):
            pass
