"""The rollout side, each piece a plain class wrapped by a thin Ray actor: rollout workers that generate groups
with behavior log-probs (worker.py) and the replay buffer that hands them to the trainer under the staleness
limit (replay_buffer.py)."""

from dppo.workers.rollout.replay_buffer import ReplayBufferActor, ReplayBufferCore, Ticket
from dppo.workers.rollout.worker import RolloutGenerator, RolloutWorkerActor

__all__ = ["ReplayBufferActor", "ReplayBufferCore", "RolloutGenerator", "RolloutWorkerActor", "Ticket"]
