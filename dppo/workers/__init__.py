"""Rollout workers and the replay buffer: plain classes, and the thin Ray actors that wrap them."""

from dppo.workers.replay_buffer import ReplayBufferActor, ReplayBufferCore, Ticket
from dppo.workers.rollout_worker import RolloutGenerator, RolloutWorkerActor

__all__ = ["ReplayBufferActor", "ReplayBufferCore", "RolloutGenerator", "RolloutWorkerActor", "Ticket"]
