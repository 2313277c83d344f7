"""What the trainer's rollout sources share (dppo.trainer.rollout.sources on Ray or in-process,
dppo.trainer.rollout.local in local processes): the rollout's one failure, the replay buffer's start, and the
torch-free groups the buffer held turned back into Groups."""

from __future__ import annotations

import torch

from dppo.batch import Group
from dppo.checkpoint.state import RolloutStart
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
    return [Group.from_arrays({**s.arrays, "index": s.index}) for s in stored], dropped


def buffer_core(cfg, start: RolloutStart, cls=ReplayBufferCore):
    """The replay buffer of cfg (cls: ReplayBufferCore, or a Ray actor's .remote taking its arguments), picking up
    where start says."""
    return cls(cfg.replay.max_off_policy_threshold, cfg.replay.max_off_policy_strategy, cfg.trainer.train_batch_size,
               start.version, start_consumed=start.consumed, start_grant=start.next_grant,
               start_dropped=start.dropped_total)  # fmt: skip


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
