"""Rollout workers: sample n responses per prompt with the behavior policy and score them.

RolloutGenerator is the plain logic (a model copy, a prompt sampler, the sampling loop); the Ray actor
RolloutWorkerActor only moves data: at each generation boundary it asks the replay buffer for a ticket,
loads the newer weights the ticket carries (one object-store get), generates and hands the groups back.
A worker that Ray gave a GPU (a bundle of the rollout's pool, rollout.n_gpus_per_node) generates on it.
"""

from __future__ import annotations

import os

import numpy as np
import ray
import torch

from dppo.algo import GREEDY_BASELINE_ESTIMATORS
from dppo.data.source import PromptSource
from dppo.generation import sample_responses
from dppo.hostmem import keep_freed_host_memory
from dppo.models import model_from_config, response_log_probs
from dppo.rollout import Group, left_pad

# Tags the SeedSequence of a ticket's streams apart from every other use of trainer.seed.
_TICKET_STREAM = 0x71C4E7


def worker_device(worker_index: int, gpu_ids: list, cuda_available: bool) -> torch.device:
    """The device of rollout worker worker_index, which Ray gave gpu_ids (ray.get_gpu_ids()): cuda:0 with a GPU
    (Ray's CUDA_VISIBLE_DEVICES shows the process its own GPUs only), the CPU without. RuntimeError if Ray gave it
    GPUs that this process's torch cannot use, rather than generating on the CPU unnoticed."""
    if not gpu_ids:
        return torch.device("cpu")
    if not cuda_available:
        raise RuntimeError(f"rollout worker {worker_index} was given GPU(s) {[str(g) for g in gpu_ids]} by Ray, but "
                           f"torch.cuda.is_available() is False in its process (torch {torch.__version__}, "
                           f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")  # fmt: skip
    return torch.device("cuda", 0)


class RolloutGenerator:
    """One worker's model copy and sampling state; generate() returns scored groups."""

    def __init__(self, cfg, source: PromptSource, model_config, worker_index: int, device: str | torch.device = "cpu"):
        """source: the trainer's PromptSource object, never rebuilt from the config here: a worker process has only
        the built-in tasks registered, not one the driver added with register_task, and need not see the data
        files. model_config: the trainer model's transformers config; the weights arrive with the first ticket.
        device: where the model copy and the sampling loop run (the groups come back on the host)."""
        self.source = source
        self.worker_index = worker_index
        self.device = torch.device(device)
        self.model = model_from_config(model_config, cfg.model.dtype).requires_grad_(False).to(self.device)
        self.seed = cfg.trainer.seed
        self.prompts = source.sampler([self.seed, _TICKET_STREAM])  # positioned per ticket
        self.generator = torch.Generator(device=self.device)
        self.n = cfg.rollout.n
        self.greedy_baseline = cfg.algorithm.adv_estimator in GREEDY_BASELINE_ESTIMATORS  # ReMax
        self.temperature = cfg.rollout.temperature
        self.max_new_tokens = cfg.rollout.max_new_tokens or source.response_length
        self.micro_batch_size = cfg.actor.micro_batch_size
        self.version = -1  # no weights loaded yet

    def seed_ticket(self, first: int) -> None:
        """Draw the next groups' prompts and samples from (trainer.seed, first), the grant index of the ticket's
        first group: what a ticket generates depends on the seed, its grant index and the weights only, not on
        the worker or the moment (a ticket granted again after its worker died; a resumed run)."""
        prompt_seed, sample_seed = np.random.SeedSequence([self.seed, _TICKET_STREAM, first]).generate_state(2)
        self.prompts.start_ticket(first, int(prompt_seed))
        self.generator.manual_seed(int(sample_seed))

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """state_dict: the published weights, on the host; copied into the model on its device."""
        self.model.load_state_dict(state_dict)
        self.version = version

    @torch.no_grad()
    def generate(self, num_groups: int) -> list[Group]:
        """num_groups fresh prompts, n sampled responses each, scored and tagged with the current version."""
        if self.version < 0:
            raise RuntimeError("RolloutGenerator.generate called before any weights were loaded")
        source = self.source
        sampled = self.prompts.sample(num_groups)  # G rows
        prompts = sampled.repeat(self.n)  # G n rows
        prompt_ids, prompt_mask = left_pad(prompts.token_ids, source.pad_token)  # (G n, P) each; mask None: no padding
        ids = prompt_ids.to(self.device)
        pad_mask = None if prompt_mask is None else prompt_mask.to(self.device)
        responses, mask = sample_responses(self.model, ids, self.max_new_tokens, self.temperature,
                                           self.generator, source.eos_token, source.pad_token, pad_mask)  # fmt: skip
        # Behavior log-probs are re-scored with a full forward pass by the same function the trainer uses,
        # so that pi_behav and pi_old agree bitwise when the weights agree.
        attention_mask = None if pad_mask is None else torch.cat([pad_mask, mask.long()], 1)
        behav_logp = response_log_probs(self.model, torch.cat([ids, responses], 1), responses.shape[1],
                                        self.temperature, self.micro_batch_size, attention_mask=attention_mask)  # fmt: skip
        responses, mask, behav_logp = responses.cpu(), mask.cpu(), behav_logp.cpu()  # (G n, R) each: to the host
        scored = source.score(prompts, responses.numpy(), mask.numpy())
        scores = torch.from_numpy(scored.scores)
        extra = {key: torch.from_numpy(values) for key, values in scored.extra.items()}
        baselines = self.greedy_baseline_scores(sampled) if self.greedy_baseline else [float("nan")] * num_groups
        width = prompt_ids.shape[1]
        return [
            Group(prompt_ids[i, width - len(prompts.token_ids[i]) :], responses[i : i + self.n], mask[i : i + self.n],
                  behav_logp[i : i + self.n], scores[i : i + self.n], self.version,
                  reward_extra={key: values[i : i + self.n] for key, values in extra.items()},
                  baseline_score=baselines[i // self.n])  # fmt: skip
            for i in range(0, prompt_ids.shape[0], self.n)
        ]

    def greedy_baseline_scores(self, prompts) -> list[float]:
        """The score of one greedy response (temperature 0: no random draw) to each of prompts (G rows): ReMax's
        baseline, generated with the group and not trained on."""
        source = self.source
        prompt_ids, prompt_mask = left_pad(prompts.token_ids, source.pad_token)  # (G, P) each
        pad_mask = None if prompt_mask is None else prompt_mask.to(self.device)
        responses, mask = sample_responses(self.model, prompt_ids.to(self.device), self.max_new_tokens, 0.0,
                                           self.generator, source.eos_token, source.pad_token, pad_mask)  # fmt: skip
        return source.score(prompts, responses.cpu().numpy(), mask.cpu().numpy()).scores.astype(float).tolist()


class RolloutWorkerActor:
    """Ray actor: generate batches of groups between weight reloads until the replay buffer closes."""

    def __init__(self, cfg, source: PromptSource, model_config, worker_index: int, buffer, holder: int):
        """holder: this incarnation's id at the replay buffer (a restarted worker gets a new one)."""
        keep_freed_host_memory()  # this actor's own process: generation's freed KV caches stay mapped
        torch.set_num_threads(cfg.rollout.num_threads)
        device = worker_device(worker_index, ray.get_gpu_ids(), torch.cuda.is_available())
        self.core = RolloutGenerator(cfg, source, model_config, worker_index, device)
        self.buffer = buffer
        self.holder = holder
        self.groups_per_batch = cfg.rollout.groups_per_batch

    def step(self, num_groups: int) -> int:
        """One generation boundary: wait for a ticket, load newer weights, generate; groups made (0: stopped)."""
        ticket = ray.get(self.buffer.acquire.remote(self.core.version, num_groups, self.holder))
        if ticket.stop:
            return 0
        if ticket.weights is not None:
            self.core.load_weights(ray.get(ticket.weights[0]), ticket.version)
        self.core.seed_ticket(ticket.first)
        groups = self.core.generate(ticket.num_groups)
        ray.get(self.buffer.put.remote(groups, ticket.first, self.holder))
        return len(groups)

    def run(self) -> None:
        """Separate-async mode: generate continuously until the buffer is closed."""
        while self.step(self.groups_per_batch):
            pass
