"""How one call on the actor's worker group reaches its ranks (verl's dispatch modes), and how a batch is split.

A rank method carries its mode (@register); the worker group calls it on every rank and applies the mode:

    ALL        the same arguments to every rank; the list of results, in rank order
    RANK0      the same arguments to every rank (the method may be collective); rank 0's result
    DP         data parallel: the call's TrainBatch and every tensor with one row per sequence of it are split
               into world_size shards of EQUAL row count (split_rows); other arguments go to every rank whole;
               rank 0's result (the ranks reduce their results among themselves)
    DP_GATHER  the first argument is a list of TrainBatches, each split as DP splits it; the rest go to every
               rank whole. Each rank returns one tensor per batch with one row per row of its shard; the call
               returns per batch its whole rows: the ranks' real rows concatenated in rank order (split_each,
               gather_rows). One call carries several mini-batches (one round trip to Ray actors)

Equal row counts keep the ranks' collectives matched: every forward and backward pass of FSDP2 all-gathers
and reduce-scatters, so a rank with fewer sequences must still run as many micro-batches as the others.
The shards are contiguous; the shorter ones are padded with copies of a row whose response_mask is all
False, which adds no token and no sequence to any loss, normalizer or metric.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from dppo.batch import TrainBatch

ALL, RANK0, DP, DP_GATHER = "all", "rank0", "dp", "dp_gather"
DISPATCH_MODES = (ALL, RANK0, DP, DP_GATHER)


def register(mode: str) -> Callable[[Callable], Callable]:
    """Mark a rank method as callable through the worker group with dispatch mode `mode`."""
    if mode not in DISPATCH_MODES:
        raise ValueError(f"unknown dispatch mode {mode!r}; valid modes: {', '.join(DISPATCH_MODES)}")

    def mark(method: Callable) -> Callable:
        method.dispatch_mode = mode
        return method

    return mark


def dispatch_mode(cls: type, name: str) -> str:
    """The dispatch mode of cls.name; AttributeError if it is not a registered rank method."""
    mode = getattr(getattr(cls, name, None), "dispatch_mode", None)
    if mode is None:
        registered = sorted(n for n in dir(cls) if getattr(getattr(cls, n, None), "dispatch_mode", None))
        raise AttributeError(f"{cls.__name__}.{name} is not a worker-group method; registered: {', '.join(registered)}")
    return mode


def shard_index(num_rows: int, world_size: int) -> list[torch.Tensor]:
    """Row indices of each rank's shard: contiguous ranges (sizes differ by at most one), each padded to the
    largest size with its last row, or row 0 where the range is empty. Padding rows come last."""
    ranges = np.array_split(np.arange(num_rows), world_size)
    rows = max(len(r) for r in ranges)
    out = []
    for r in ranges:
        pad_source = int(r[-1]) if len(r) else 0
        out.append(torch.tensor([*r.tolist(), *[pad_source] * (rows - len(r))], dtype=torch.long))
    return out


def real_rows(num_rows: int, world_size: int) -> list[int]:
    """How many rows of each shard of shard_index are real (the rest are padding)."""
    return [len(r) for r in np.array_split(np.arange(num_rows), world_size)]


def split_rows(batch: TrainBatch, world_size: int) -> list[TrainBatch]:
    """batch split over world_size ranks (shard_index), padding rows masked out (response_mask all False)."""
    shards = []
    for index, real in zip(shard_index(batch.num_sequences, world_size), real_rows(batch.num_sequences, world_size)):
        shard = batch[index]  # every per-sequence field's rows (copies), the groups renumbered
        if real < len(index):
            shard.response_mask[real:] = False
        shards.append(shard)
    return shards


def split_args(args: Sequence[Any], world_size: int) -> list[list[Any]]:
    """Per-rank argument lists for a DP call: the TrainBatch and every tensor with its rows split, the rest whole."""
    batches = [a for a in args if isinstance(a, TrainBatch)]
    if len(batches) != 1:
        raise TypeError(f"a DP call takes exactly one TrainBatch argument, got {len(batches)}")
    if world_size == 1:
        return [list(args)]
    num_rows = batches[0].num_sequences
    index = shard_index(num_rows, world_size)
    per_rank: list[list[Any]] = [[] for _ in range(world_size)]
    for arg in args:
        if isinstance(arg, TrainBatch):
            parts: list[Any] = split_rows(arg, world_size)
        elif isinstance(arg, torch.Tensor) and arg.dim() > 0 and arg.shape[0] == num_rows:
            parts = [arg[i.to(arg.device)] for i in index]
        else:
            parts = [arg] * world_size
        for rank, part in enumerate(parts):
            per_rank[rank].append(part)
    return per_rank


def collect(mode: str, results: list[Any]) -> Any:
    """What the worker group returns for a call in `mode` (not DP_GATHER: gather_rows), given every rank's result."""
    return results if mode == ALL else results[0]


def split_each(args: Sequence[Any], world_size: int) -> list[list[Any]]:
    """Per-rank argument lists for a DP_GATHER call: its first argument, a list of TrainBatches, with each batch's
    rows split (split_rows), the rest whole."""
    if not args or not isinstance(args[0], list) or not all(isinstance(b, TrainBatch) for b in args[0]):
        got = type(args[0]).__name__ if args else "nothing"
        raise TypeError(f"a DP_GATHER call takes a list of TrainBatches as its first argument, got {got}")
    batches, *rest = args
    shards = [split_rows(b, world_size) if world_size > 1 else [b] for b in batches]
    return [[[s[rank] for s in shards], *rest] for rank in range(world_size)]


def gather_rows(results: list[list[torch.Tensor]], num_rows: list[int]) -> list[torch.Tensor]:
    """Per batch of a DP_GATHER call (num_rows rows each), the ranks' real rows of their results, in rank order."""
    world_size = len(results)
    return [
        torch.cat([results[rank][i][:real] for rank, real in enumerate(real_rows(rows, world_size))])
        for i, rows in enumerate(num_rows)
    ]
