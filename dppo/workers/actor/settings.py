"""ActorSettings: what an actor rank reads of a run, bundled once by the driver (dppo.trainer.worker_group.
actor_settings) and handed to every rank as it is. A rank never sees the config itself: its own sections (actor,
model), the two it computes with (algorithm: the rollout correction and the KL in the reward; rollout: the sampling
temperature of its log-probs and the engine's dtype and checks its publishes serve) and the trainer's few values."""

from __future__ import annotations

from dataclasses import dataclass

from dppo.config import ActorConfig, AlgorithmConfig, ModelConfig, RolloutConfig


@dataclass(frozen=True)
class ActorSettings:
    """An actor rank's part of a run (see the module docstring)."""

    actor: ActorConfig  # the update: optimizer and lr schedule, clips, the losses, precision, sharding
    algorithm: AlgorithmConfig  # the rollout correction; algorithm.use_kl_in_reward keeps a reference policy
    model: ModelConfig  # the policy the rank builds, and model.dtype
    rollout: RolloutConfig  # rollout.temperature (log-probs of the sampling distribution), the publishes' dtype
    seed: int  # trainer.seed: the model's initial weights and the losses' random draws
    device: str  # trainer.device
    num_threads: int  # trainer.num_threads: torch's threads on the rank
    collective_timeout_s: float  # trainer.collective_timeout_s: how long a sharded rank waits in a collective
    total_steps: int  # trainer.total_steps: the lr schedule's length in global steps
    parameter_sync_step: int  # trainer.parameter_sync_step: optimizer steps per global step (the lr schedule)
