"""Weight-sync verification (rollout.verify_sync): exact per-tensor checksums of the weights a rollout engine holds.

The trainer fingerprints what it publishes (once per version, in the rollout engine's dtype, keyed by the
checkpoint's (transformers') names) and the fingerprint travels with the ticket that hands the version to a worker;
after the worker's engine has loaded the version, it reads back what the engine now holds, fingerprints that the same
way and compares (dppo.workers.rollout.worker). A difference raises WeightSyncMismatchError naming the first tensor
that differs: a load that silently dropped or altered a tensor is never mistaken for staleness.

A tensor's checksum is exact and cheap: its elements' bit patterns as int64, each multiplied by an odd multiplier that
depends on its position, summed with wrapping int64 arithmetic (the sum is modular, so any summation order gives the
same value on any machine). A change of one element by d changes the sum by d x an odd number, never 0 modulo 2**64:
one flipped bit always shows. Two changes could in principle cancel; for that their positions' multipliers would
have to line up with their differences (about 2**-64 for unrelated changes).

Shared by the trainer's side (the sources, the actor's rank 0) and the workers', so it lives here; what travels
(WeightFingerprint: names, shapes and ints) and the comparison are torch-free, in dppo.workers.sync_check (the
replay buffer's process holds a fingerprint between a publish and the tickets that hand it out).
"""

from __future__ import annotations

import torch

from dppo.models import DTYPES
from dppo.workers.sync_check import TensorPrint, WeightFingerprint
from dppo.workers.weight_delta import bits

_COLUMNS = 1024  # a tensor is checksummed as rows of this many elements
_CHUNK_ROWS = 4096  # rows converted to int64 at a time (8 MiB of temporaries)
# multipliers of row i and column j: (i * MUL + ADD) | 1, wrapping int64 (MULs: odd 64-bit mixing constants as
# signed ints, 0x9E3779B97F4A7C15 and 0xBF58476D1CE4E5B9); element (i, j) is weighted by their product, odd
_ROW_MUL, _ROW_ADD = -7046029254386353131, 7809847782465536322
_COL_MUL, _COL_ADD = -4658895280553007687, 1442695040888963407


def _multipliers(start: int, count: int, mul: int, add: int) -> torch.Tensor:
    """The odd int64 multipliers of positions start .. start + count - 1: distinct for distinct positions."""
    return (torch.arange(start, start + count, dtype=torch.int64) * mul + add) | 1


_COLUMN_MULTIPLIERS = _multipliers(0, _COLUMNS, _COL_MUL, _COL_ADD)


def checksum(tensor: torch.Tensor) -> int:
    """The tensor's exact checksum: its bits (flat, row-major) weighted by position, summed modulo 2**64 (an int64)."""
    flat = bits(tensor.detach().contiguous())  # (n,) integers of the element width
    n = flat.numel()
    total = torch.zeros((), dtype=torch.int64)
    step = _COLUMNS * _CHUNK_ROWS
    for start in range(0, n, step):
        chunk = flat[start : start + step].to(torch.int64)
        pad = -chunk.numel() % _COLUMNS
        if pad:
            chunk = torch.cat([chunk, chunk.new_zeros(pad)])
        rows = chunk.view(-1, _COLUMNS)  # (r, C)
        row_sums = (rows * _COLUMN_MULTIPLIERS).sum(1)  # (r,) int64, wrapping
        total += (row_sums * _multipliers(start // _COLUMNS, rows.shape[0], _ROW_MUL, _ROW_ADD)).sum()
    return int(total)


def tied_names(state_dict: dict[str, torch.Tensor]) -> dict[str, str]:
    """name -> the earlier name whose tensor it is (same memory, shape, strides and dtype)."""
    owners: dict[tuple, str] = {}
    aliases = {}
    for name, t in state_dict.items():
        key = (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
        if key in owners and t.numel():
            aliases[name] = owners[key]
        else:
            owners.setdefault(key, name)
    return aliases


def fingerprint(state_dict: dict[str, torch.Tensor], dtype: torch.dtype) -> WeightFingerprint:
    """The fingerprint of state_dict's tensors converted to dtype (a tensor at a time; a tied tensor once)."""
    aliases = tied_names(state_dict)
    out = WeightFingerprint(str(dtype).removeprefix("torch."), aliases=aliases)
    for name, tensor in state_dict.items():
        if name in aliases:
            out.tensors[name] = out.tensors[aliases[name]]
            continue
        out.tensors[name] = TensorPrint(tuple(tensor.shape), checksum(tensor.detach().to(dtype)))
    return out


def prints_of(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, TensorPrint]:
    """The prints of an engine's tensors (checkpoint names), each converted to the engine's dtype (lossless for a tensor
    the engine keeps wider than its dtype, e.g. vLLM's fp32 biases of a bf16 model on the CPU); a tied tensor once."""
    aliases = tied_names(tensors)
    out = {}
    for name, t in tensors.items():
        out[name] = (
            out[aliases[name]] if name in aliases else TensorPrint(tuple(t.shape), checksum(t.detach().to(dtype)))
        )
    return out


def print_dtype(rollout, model_dtype: str) -> torch.dtype | None:
    """The dtype a publish is fingerprinted in, the rollout engine's (rollout.dtype, else model_dtype: model.dtype);
    None where rollout.verify_sync is off (rollout: the config's rollout section)."""
    return DTYPES[rollout.dtype or model_dtype] if rollout.verify_sync else None


def fingerprint_for(state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None) -> WeightFingerprint | None:
    """fingerprint(state_dict, dtype), or None where dtype is (verification off: print_dtype)."""
    return None if dtype is None else fingerprint(state_dict, dtype)
