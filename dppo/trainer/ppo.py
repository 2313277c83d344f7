"""Decoupled PPO (and its bypass mode) on the base trainer's loop.

Per trigger: old log-probs (the strategy chosen in dppo.trainer.prox) -> advantages -> rollout correction
(IS weights and the rejection-modified loss mask; in bypass mode per micro-batch, on pi_theta) -> policy
loss over the loss mask -> one optimizer step. Which policy plays pi_old is the strategy's business; which loss
is used is chosen once in setup(); the trigger itself has no algorithm branches.
"""

from __future__ import annotations

import copy
import time

import torch

from dppo.models import response_log_probs
from dppo.rollout import TrainBatch
from dppo.trainer.actor import advantage_fn, bypass_objective, decoupled_objective, update_policy
from dppo.trainer.base import BaseTrainer
from dppo.trainer.prox import make_old_log_prob


class PPOTrainer(BaseTrainer):
    """Decoupled PPO with GRPO/RLOO advantages; bypass mode when algorithm.rollout_correction.bypass_mode."""

    def setup(self) -> None:
        cfg = self.cfg
        rc = cfg.algorithm.rollout_correction
        self.rollout_correction = rc.to_algo()
        make_objective = bypass_objective if rc.bypass_mode else decoupled_objective
        self.objective = make_objective(cfg.actor, self.rollout_correction)
        self.advantages = advantage_fn(cfg.algorithm)
        self.old_log_prob = make_old_log_prob(self.model, self.optimizer, self.score, cfg)
        self.ref_model = None
        if cfg.actor.kl_loss_coef > 0:  # the reference policy of the KL penalty: the initial weights
            self.ref_model = copy.deepcopy(self.model).requires_grad_(False)
            if getattr(self, "_ref_state", None) is not None:  # resumed: the run's initial weights
                self.ref_model.load_state_dict(self._ref_state)

    def extra_state(self) -> dict:
        return {"ref_model": self.ref_model.state_dict()} if self.ref_model is not None else {}

    def load_extra_state(self, state: dict) -> None:
        self._ref_state = state.get("ref_model")

    def cycle_anchor(self) -> dict[str, torch.Tensor] | None:
        return self.old_log_prob.anchor_weights()

    def load_cycle_anchor(self, weights: dict[str, torch.Tensor]) -> None:
        self.old_log_prob.load_anchor(weights)

    @torch.no_grad()
    def score(self, module: torch.nn.Module, batch: TrainBatch, params=None) -> torch.Tensor:
        """log pi (B, R) of module (or of module's graph on params) for the batch's responses."""
        return response_log_probs(module, batch.input_ids, batch.response_length, self.cfg.rollout.temperature,
                                  self.cfg.actor.micro_batch_size, params, batch.attention_mask)  # fmt: skip

    def train_trigger(self, batch: TrainBatch) -> dict[str, float]:
        start = time.perf_counter()
        prox_logp = self.old_log_prob.compute(self.local_trigger_step, batch)  # (B, R)
        old_log_prob_s = time.perf_counter() - start
        advantages = self.advantages(batch.scores, batch.group_index, batch.response_mask)  # (B, R)
        objective = self.objective(batch, prox_logp, advantages)  # the rollout correction, in Decoupled PPO
        metrics = dict(objective.metrics)
        ref_logp = self.score(self.ref_model, batch) if self.ref_model is not None else None
        start = time.perf_counter()
        metrics.update(update_policy(self.model, self.optimizer, batch, objective, self.cfg.actor,
                                     self.cfg.rollout.temperature, ref_logp))  # fmt: skip
        metrics["timing_s/update_actor"] = time.perf_counter() - start
        metrics["timing_s/old_log_prob"] = old_log_prob_s
        metrics["timing_s/snapshot"] = self.old_log_prob.take_snapshot_s()
        metrics["response_length/mean"] = float(batch.response_mask.sum(-1).float().mean())
        return metrics

    def end_cycle(self) -> dict[str, float]:
        return self.old_log_prob.end_cycle()

    def close(self) -> None:
        self.old_log_prob.close()
