"""What the trainer's rollout sources share (ray_source, local_source, in_process): the rollout's one failure, the
config the sources decide with, the replay buffer's start, the torch-free groups the buffer held turned back into
Groups, and a copy of published weights that later steps do not reach."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dppo.batch import Group
from dppo.lora import LoraPublish
from dppo.trainer.state import RolloutStart
from dppo.config import DppoConfig, ReplayConfig, RolloutConfig
from dppo.workers.rollout.replay_buffer import ReplayBufferCore, StoredGroup


class RolloutFailedError(RuntimeError):
    """The rollout cannot go on: the replay buffer died, a rollout worker died once more than rollout.max_restarts
    allows, or a rollout worker raised. The message names what, in one line."""


def groups_of(taken: tuple[list[StoredGroup], int] | None) -> tuple[list[Group], int] | None:
    """What a replay buffer's take returned, with its torch-free StoredGroups as Groups again (copies: Ray may hand
    back read-only arrays)."""
    if taken is None:
        return None
    stored, dropped = taken
    return [Group.from_arrays({**s.arrays, "index": s.index, "ticket": s.ticket}) for s in stored], dropped


@dataclass(frozen=True)
class RolloutSettings:
    """What a rollout source decides with: its own config sections and the two trainer values it needs. (Its
    workers get theirs, a RolloutWorkerSettings: dppo.trainer.rollout.settings.)"""

    rollout: RolloutConfig
    replay: ReplayConfig
    mode: str  # trainer.mode: separate_async (the workers run on their own) or sync (they generate when asked)
    train_batch_size: int  # trainer.train_batch_size: groups consumed per version, the replay buffer's budget unit

    @classmethod
    def of(cls, cfg: DppoConfig) -> RolloutSettings:
        return cls(cfg.rollout, cfg.replay, cfg.trainer.mode, cfg.trainer.train_batch_size)


def buffer_core(settings: RolloutSettings, start: RolloutStart, cls=ReplayBufferCore):
    """The replay buffer of settings (cls: ReplayBufferCore, or a Ray actor's .remote taking its arguments), picking
    up where start says."""
    replay = settings.replay
    return cls(
        replay.max_off_policy_threshold,
        replay.max_off_policy_strategy,
        settings.train_batch_size,
        start.version,
        start_consumed=start.consumed,
        start_grant=start.next_grant,
        start_dropped=start.dropped_total,
    )


def cloned_state(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of state_dict that no later in-place update of its tensors reaches (a plain module's CPU state dict
    aliases its live parameters); tensors that are one (a tied embedding) stay one in the copy."""
    copies: dict[tuple, torch.Tensor] = {}
    out = {}
    for name, tensor in state_dict.items():
        ident = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        if ident not in copies:
            copies[ident] = tensor.detach().clone()
        out[name] = copies[ident]
    return out


def published_copy(weights):
    """What a source that keeps a publish keeps of it: a copy of the state dict (cloned_state), or of a LoRA publish the
    adapter copied and the base as it is (the run's one copy, frozen)."""
    if isinstance(weights, LoraPublish):
        return dataclasses.replace(weights, adapter=cloned_state(weights.adapter))
    return cloned_state(weights)
