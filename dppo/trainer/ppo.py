"""Decoupled PPO (and its bypass mode) on the base trainer's loop.

Per trigger the driver computes the advantages on whole groups (dppo.algo, before the batch is split over
the ranks) and calls the actor's update once: every rank takes log pi_old from its pi_old provider
(dppo.workers.actor.pi_old) on its shard, then the rollout correction, the policy loss (normalized over the whole
mini-batch) and one optimizer step (dppo.workers.actor.rank). Which policy plays pi_old is the provider's
business; which loss is used is chosen once per rank; the trigger itself has no algorithm branches. Score-ahead is
the base loop's (dppo.trainer.score_ahead): a held mini-batch comes to train_trigger with its old log-probs.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from dppo.algo import apply_kl_penalty, get_advantage_estimator, get_kl_controller
from dppo.batch import TrainBatch
from dppo.trainer.base import BaseTrainer
from dppo.workers.actor.update import GUARD_KL_KEY

log = logging.getLogger("dppo.trainer")


def advantage_fn(algorithm_cfg) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """advantages(scores (B,), group_index (B,), response_mask (B, R)) -> (B, R) for algorithm.adv_estimator."""
    estimator = get_advantage_estimator(
        algorithm_cfg.adv_estimator
    )  # takes verl's keys, ignores those it does not read
    return functools.partial(estimator, norm_adv_by_std_in_grpo=algorithm_cfg.norm_adv_by_std_in_grpo)


class PPOTrainer(BaseTrainer):
    """Decoupled PPO with verl's advantage estimators and policy losses; bypass mode when algorithm.rollout_correction.bypass_mode."""

    def setup(self) -> None:
        self.advantages = advantage_fn(self.cfg.algorithm)
        ctrl = self.cfg.algorithm.kl_ctrl
        self.kl_ctrl = (
            get_kl_controller(ctrl.type, ctrl.kl_coef, ctrl.target_kl, ctrl.horizon)
            if self.cfg.algorithm.use_kl_in_reward
            else None
        )
        if self.kl_ctrl is not None and "kl_ctrl_value" in self.resumed_algorithm_state:
            self.kl_ctrl.value = float(self.resumed_algorithm_state["kl_ctrl_value"])  # adaptive: where it was

    def algorithm_state(self) -> dict:
        return {} if self.kl_ctrl is None else {"kl_ctrl_value": self.kl_ctrl.value}

    def train_trigger(self, batch: TrainBatch, prox_logp: torch.Tensor | None = None) -> dict[str, float]:
        extra = {} if batch.reward_baselines is None else {"reward_baselines": batch.reward_baselines}  # ReMax's
        scores, kl_metrics = self.kl_in_reward(batch) if self.kl_ctrl is not None else (batch.scores, {})
        advantages = self.advantages(scores, batch.group_index, batch.response_mask, **extra)  # (B, R)
        metrics = self.actor_group.update_actor(self.local_trigger_step, batch, advantages, self.version, prox_logp)
        if metrics.get("actor/skipped_updates"):
            log.warning(
                f"step {self.global_step + 1}, trigger {self.local_trigger_step}: {GUARD_KL_KEY}="
                f"{metrics.get(GUARD_KL_KEY, float('nan')):.4g} > actor.max_ppo_kl={self.cfg.actor.max_ppo_kl:g}; "
                "the update was skipped (weights and optimizer state unchanged)"
            )
        metrics.update(kl_metrics)
        metrics["response_length/mean"] = float(batch.response_mask.sum(-1).float().mean())
        return metrics

    def kl_in_reward(self, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """algorithm.use_kl_in_reward: each sequence's summed token-level reward (B,), its score at the last valid
        token minus beta x KL(pi || pi_ref) per valid token (dppo.algo.apply_kl_penalty, verl's), and the metrics."""
        both = self.actor_group.reward_kl_log_probs([batch])[0]  # (B, R, 2): the live weights', the reference's
        mask = batch.response_mask
        # (B,) the last valid token (a row without any keeps its score at the last position: no penalty, as before)
        last = mask.shape[1] - 1 - mask.flip(-1).int().argmax(-1)
        token_scores = torch.zeros(mask.shape)
        token_scores[torch.arange(mask.shape[0]), last] = batch.scores.float()
        rewards, metrics = apply_kl_penalty(
            token_scores, both[..., 0], both[..., 1], mask, self.kl_ctrl, self.cfg.algorithm.kl_penalty
        )
        return rewards.sum(-1), metrics  # (B,)

    def end_cycle(self) -> dict[str, float]:
        return self.actor_group.end_cycle()
