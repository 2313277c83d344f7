"""Decoupled PPO (and its bypass mode) on the base trainer's loop.

Per trigger: old log-probs (the strategy chosen in dppo.trainer.prox) -> advantages -> rollout correction
-> policy loss -> one optimizer step. Which policy plays pi_old is the strategy's business; which loss
is used is chosen once in setup(); the trigger itself has no algorithm branches.
"""

from __future__ import annotations

import copy
import time

import torch

from dppo.algo import compute_rollout_correction
from dppo.models import response_log_probs
from dppo.rollout import TrainBatch
from dppo.trainer.actor import LossFn, advantage_fn, bypass_loss, decoupled_loss, update_policy
from dppo.trainer.base import BaseTrainer
from dppo.trainer.prox import make_old_log_prob


def _no_correction(prox_logp, behav_logp, mask, config):
    """Bypass mode: pi_prox is pi_behav, so the weight pi_prox / pi_behav is 1 and there is nothing to correct."""
    return None, {}


def _with_behavior_drift(loss_fn: LossFn, config) -> LossFn:
    """Bypass ppo_clip plus rollout_corr/* diagnostics of pi_theta against pi_behav (what verl logs there).

    pi_old := pi_behav, so the decoupled diagnostics (pi_old / pi_behav) would be identically 1, and the loss
    applies no weights: its PPO ratio pi_theta / pi_behav already is the correction. What is worth watching is
    how far the policy being updated has drifted from the one that sampled: compute_rollout_correction on
    pi_theta (detached) against pi_behav under algorithm.rollout_correction, its weights discarded."""

    def loss_fn_with_drift(logp, prox_logp, behav_logp, advantages, mask, weights):
        loss, metrics = loss_fn(logp, prox_logp, behav_logp, advantages, mask, weights)
        _, drift = compute_rollout_correction(logp.detach(), behav_logp, mask, config)  # (b, R) weights unused
        return loss, {**metrics, **drift}

    return loss_fn_with_drift


class PPOTrainer(BaseTrainer):
    """Decoupled PPO with GRPO/RLOO advantages; bypass mode when algorithm.rollout_correction.bypass_mode."""

    def setup(self) -> None:
        cfg = self.cfg
        rc = cfg.algorithm.rollout_correction
        self.rollout_correction = rc.to_algo()
        self.loss_fn = bypass_loss(cfg.actor, self.rollout_correction) if rc.bypass_mode else decoupled_loss(cfg.actor)
        if rc.bypass_mode and rc.loss_type == "ppo_clip":  # reinforce's loss reports its rollout_corr/* itself
            self.loss_fn = _with_behavior_drift(self.loss_fn, self.rollout_correction)
        self.correction_fn = _no_correction if rc.bypass_mode else compute_rollout_correction
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

    @torch.no_grad()
    def score(self, module: torch.nn.Module, batch: TrainBatch, params=None) -> torch.Tensor:
        """log pi (B, R) of module (or of module's graph on params) for the batch's responses."""
        return response_log_probs(module, batch.input_ids, batch.response_length, self.cfg.rollout.temperature,
                                  self.cfg.actor.micro_batch_size, params)  # fmt: skip

    def train_trigger(self, batch: TrainBatch) -> dict[str, float]:
        start = time.perf_counter()
        prox_logp = self.old_log_prob.compute(self.local_trigger_step, batch)  # (B, R)
        old_log_prob_s = time.perf_counter() - start
        advantages = self.advantages(batch.scores, batch.group_index, batch.response_mask)  # (B, R)
        weights, metrics = self.correction_fn(prox_logp, batch.behav_logp, batch.response_mask, self.rollout_correction)
        ref_logp = self.score(self.ref_model, batch) if self.ref_model is not None else None
        start = time.perf_counter()
        metrics.update(update_policy(self.model, self.optimizer, batch, prox_logp, advantages, weights, self.loss_fn,
                                     self.cfg.actor, self.cfg.rollout.temperature, ref_logp))  # fmt: skip
        metrics["timing_s/update_actor"] = time.perf_counter() - start
        metrics["timing_s/old_log_prob"] = old_log_prob_s
        metrics["timing_s/snapshot"] = self.old_log_prob.take_snapshot_s()
        metrics["response_length/mean"] = float(batch.response_mask.sum(-1).float().mean())
        return metrics

    def end_cycle(self) -> dict[str, float]:
        return self.old_log_prob.end_cycle()

    def close(self) -> None:
        self.old_log_prob.close()
