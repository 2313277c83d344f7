"""Rollout workers: sample n responses per prompt with the behavior policy and score them.

RolloutGenerator is the plain logic (a model copy, a prompt sampler, the sampling loop); the Ray actor
RolloutWorkerActor only moves data: at each generation boundary it asks the replay buffer for a ticket,
loads the newer weights the ticket carries (one object-store get), generates and hands the groups back.
"""

from __future__ import annotations

import numpy as np
import torch

from dppo.generation import sample_responses
from dppo.models import model_from_config, response_log_probs
from dppo.rollout import Group
from dppo.tasks import PromptSampler, Task


# Tags the SeedSequence of a ticket's streams apart from every other use of trainer.seed.
_TICKET_STREAM = 0x71C4E7


class RolloutGenerator:
    """One worker's model copy and sampling state; generate() returns scored groups."""

    def __init__(self, cfg, task: Task, model_config, worker_index: int, held_out: np.ndarray | None = None):
        """task: the trainer's Task object, never looked up again by name: a worker process has only the built-in
        tasks registered, not one the driver added with register_task. model_config: the trainer model's
        transformers config; the weights arrive with the first ticket."""
        self.task = task
        self.worker_index = worker_index
        self.model = model_from_config(model_config, cfg.model.dtype).requires_grad_(False)
        self.seed = cfg.trainer.seed
        self.prompts = PromptSampler(self.task, [self.seed, _TICKET_STREAM], held_out)  # reseeded per ticket
        self.generator = torch.Generator()
        self.n = cfg.rollout.n
        self.temperature = cfg.rollout.temperature
        self.max_new_tokens = cfg.rollout.max_new_tokens or self.task.answer_length
        self.micro_batch_size = cfg.actor.micro_batch_size
        self.version = -1  # no weights loaded yet

    def seed_ticket(self, first: int) -> None:
        """Draw the next groups' prompts and samples from (trainer.seed, first), the grant index of the ticket's
        first group: what a ticket generates depends on the seed, its grant index and the weights only, not on
        the worker or the moment (a ticket granted again after its worker died; a resumed run)."""
        prompt_seed, sample_seed = np.random.SeedSequence([self.seed, _TICKET_STREAM, first]).generate_state(2)
        self.prompts.rng = np.random.default_rng(prompt_seed)
        self.generator.manual_seed(int(sample_seed))

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self.model.load_state_dict(state_dict)
        self.version = version

    @torch.no_grad()
    def generate(self, num_groups: int) -> list[Group]:
        """num_groups fresh prompts, n sampled responses each, scored and tagged with the current version."""
        if self.version < 0:
            raise RuntimeError("RolloutGenerator.generate called before any weights were loaded")
        prompts = torch.from_numpy(self.prompts.sample(num_groups)).repeat_interleave(self.n, 0)  # (G n, P)
        responses, mask = sample_responses(
            self.model, prompts, self.max_new_tokens, self.temperature, self.generator, self.task.eos_token
        )  # (G n, R) each
        # Behavior log-probs are re-scored with a full forward pass by the same function the trainer uses,
        # so that pi_behav and pi_old agree bitwise when the weights agree.
        behav_logp = response_log_probs(
            self.model, torch.cat([prompts, responses], 1), responses.shape[1], self.temperature, self.micro_batch_size
        )
        scores = torch.from_numpy(self.task.rewards(prompts.numpy(), responses.numpy(), mask.numpy()))
        return [
            Group(prompts[i], responses[i : i + self.n], mask[i : i + self.n], behav_logp[i : i + self.n],
                  scores[i : i + self.n], self.version)  # fmt: skip
            for i in range(0, prompts.shape[0], self.n)
        ]


class RolloutWorkerActor:
    """Ray actor: generate batches of groups between weight reloads until the replay buffer closes."""

    def __init__(self, cfg, task: Task, model_config, worker_index: int, held_out: np.ndarray | None, buffer,
                 holder: int):  # fmt: skip
        """holder: this incarnation's id at the replay buffer (a restarted worker gets a new one)."""
        from dppo.hostmem import keep_freed_host_memory

        keep_freed_host_memory()  # this actor's own process: generation's freed KV caches stay mapped
        torch.set_num_threads(cfg.rollout.num_threads)
        self.core = RolloutGenerator(cfg, task, model_config, worker_index, held_out)
        self.buffer = buffer
        self.holder = holder
        self.groups_per_batch = cfg.rollout.groups_per_batch

    def step(self, num_groups: int) -> int:
        """One generation boundary: wait for a ticket, load newer weights, generate; groups made (0: stopped)."""
        import ray

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
