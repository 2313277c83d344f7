"""The rollout-source interface: what the trainer (dppo.trainer.base) and the launch (dppo.launch.run) call, and
all they may call, on wherever a run's groups come from.

Three sources implement it: RayRollout (rollout workers and the replay buffer as Ray actors), LocalRollout (worker
processes beside the trainer, the buffer in its process) and InProcessRollout (trainer.mode=sync without Ray: the
groups generated in the trainer's own process). make_rollout (dppo.trainer.rollout) picks one.

A trigger's groups are identified by their grant index in the replay buffer and drawn from (trainer.seed, grant
index): whichever source generates them, and whenever, they are the same groups.
"""

from __future__ import annotations

import abc
from typing import Any

import torch

from dppo.batch import Group


class RolloutSource(abc.ABC):
    """Where the trainer's groups come from. A subclass that leaves a method out cannot be constructed (TypeError
    naming it). Any method may raise RolloutFailedError: the rollout cannot go on (the message names what, in one
    line); the trainer then checkpoints its own state and ends the run."""

    @abc.abstractmethod
    def start(self) -> None:
        """Let the workers generate on their own from now on (separate_async); the trainer calls it once, after the
        first publish. A source whose workers ask for tickets as soon as they are up, or that generates only when
        asked (sync), does nothing."""

    @abc.abstractmethod
    def publish(self, weights: Any, version: int) -> None:
        """Make weights the policy of `version` for every ticket granted from now on. weights: the rank's CPU state
        dict (its live tensors, which later steps change in place: a source that keeps them keeps a copy), or on
        Ray the [ObjectRef] of one already in the object store."""

    @abc.abstractmethod
    def published_weights(self) -> dict[str, torch.Tensor]:
        """The state dict of the last publish, exactly as published (bitwise, in the dtype it was published in): what
        a checkpoint saves as the rollout's policy. Only after a publish."""

    @abc.abstractmethod
    def fetch(self, num_groups: int, trainer_version: int) -> tuple[list[Group], int]:
        """The next num_groups groups in grant order, none staler than replay.max_off_policy_threshold at
        trainer_version, waiting for them as long as it takes (restarting workers that die meanwhile); with the
        number of groups dropped as too stale since the last take."""

    @abc.abstractmethod
    def fetch_ready(self, num_groups: int, trainer_version: int) -> tuple[list[Group], int] | None:
        """What fetch would return next if those groups have all arrived, else None, without waiting and taking
        nothing (the trainer's score-ahead at a cycle's first trigger). A source that generates only when asked
        generates them now: the same groups, seeded by their grant index."""

    @abc.abstractmethod
    def discard(self, count: int) -> None:
        """The trainer took count groups it will not train on (algorithm.filter_groups): under
        replay.max_off_policy_strategy=wait they free their place in the buffer's budget (ReplayBufferCore.discard)."""

    @abc.abstractmethod
    def stats(self) -> dict[str, float]:
        """The metrics of the moment: the replay buffer's replay/* and rollout/worker_restarts."""

    @abc.abstractmethod
    def describe(self) -> str:
        """One line for the run's report, starting "rollout: ": where the workers run."""

    @property
    @abc.abstractmethod
    def worker_restarts(self) -> int:
        """Rollout workers restarted after their process died, counted on from the RolloutStart the source was made
        with (a resumed run's earlier ones included): what the next checkpoint records. 0 where no worker can die
        apart from the trainer (InProcessRollout)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the workers and the buffer and free what they hold; never raises (any of them may be dead already).
        Nothing is used after it."""
