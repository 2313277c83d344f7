"""Weight-sync verification (rollout.verify_sync): exact per-tensor checksums of the weights a rollout engine holds.

The trainer fingerprints what it publishes (once per version, in the rollout engine's dtype, keyed by the
checkpoint's (transformers') names) and the fingerprint travels with the ticket that hands the version to a worker;
after the worker's engine has loaded the version, it reads back what the engine now holds, fingerprints that the same
way and compares (dppo.workers.rollout.worker). A difference raises WeightSyncMismatchError naming the first tensor
that differs: a load that silently dropped or altered a tensor is never mistaken for staleness.

A tensor's checksum is exact and cheap (every NaN counts as one value: conversions disagree on a NaN's bits): its
elements' bit patterns as int64, each multiplied by an odd multiplier that
depends on its position, summed with wrapping int64 arithmetic (the sum is modular, so any summation order gives the
same value on any machine). A change of one element by d changes the sum by d x an odd number, never 0 modulo 2**64:
one flipped bit always shows. Two changes could in principle cancel; for that their positions' multipliers would
have to line up with their differences (about 2**-64 for unrelated changes).

Shared by the trainer's side (the sources, the actor's rank 0) and the workers', so it lives here; what travels
(WeightFingerprint: names, shapes and ints) and the comparison are torch-free, in dppo.workers.sync_check (the
replay buffer's process holds a fingerprint between a publish and the tickets that hand it out).
"""

from __future__ import annotations

import numpy as np
import torch

from dppo.lora import LoraPublish
from dppo.models import DTYPES
from dppo.workers.sync_check import TensorPrint, WeightFingerprint
from dppo.workers.weight_delta import bits

_COLUMNS = 1024  # a tensor is checksummed as rows of this many elements
_CHUNK_ROWS = 64  # rows converted to int64 at a time (512 KiB of temporaries: they stay in the cache)
# multipliers of row i and column j: (i * MUL + ADD) | 1, wrapping int64 (MULs: odd 64-bit mixing constants as
# signed ints, 0x9E3779B97F4A7C15 and 0xBF58476D1CE4E5B9); element (i, j) is weighted by their product, odd
_ROW_MUL, _ROW_ADD = -7046029254386353131, 7809847782465536322
_COL_MUL, _COL_ADD = -4658895280553007687, 1442695040888963407
_MASK = (1 << 64) - 1


def _multipliers(start: int, count: int, mul: int, add: int) -> np.ndarray:
    """The odd int64 multipliers of positions start .. start + count - 1: distinct for distinct positions."""
    return (np.arange(start, start + count, dtype=np.int64) * np.int64(mul) + np.int64(add)) | np.int64(1)


_COLUMN_MULTIPLIERS = _multipliers(0, _COLUMNS, _COL_MUL, _COL_ADD)


def _bf16_bits(fp32_bits: np.ndarray) -> np.ndarray:
    """The bits of fp32 values (int32) rounded to bfloat16 as torch rounds them (to nearest, ties to even), as int16,
    without torch (c10::BFloat16's round_to_nearest_even); every NaN as bf16's one NaN (0x7FC0, what _one_nan makes of
    any NaN). The rounding's carry would otherwise turn a NaN whose payload is all ones into a zero (0x7FFFFFFF ->
    -0, 0xFFFFFFFF -> +0) and one whose payload lies in its low 16 bits into an infinity (0x7F800001 -> +inf), where
    torch gives a NaN."""
    u = fp32_bits.view(np.uint32)
    rounded = (
        ((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16))
        .astype(np.uint16)
        .view(np.int16)
    )
    is_nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if is_nan.any():
        rounded[is_nan] = np.int16(0x7FC0)
    return rounded


# float dtype -> (the bits without the sign, the bits of inf, one NaN): any NaN is checksummed as that one
_NAN_BITS = {
    torch.bfloat16: (0x7FFF, 0x7F80, 0x7FC0),
    torch.float16: (0x7FFF, 0x7C00, 0x7E00),
    torch.float32: (0x7FFFFFFF, 0x7F800000, 0x7FC00000),
}


def _one_nan(chunk: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """chunk (bits in dtype) with every NaN as the same NaN: conversions disagree on a NaN's sign and payload (torch's
    vectorized fp32 -> bf16 gives 0xFFFF where its scalar path gives 0x7FC0), so a check that told NaNs apart would
    fail a correct load."""
    if dtype not in _NAN_BITS:
        return chunk
    magnitude, inf, nan = _NAN_BITS[dtype]
    is_nan = (chunk & magnitude) > inf
    if not is_nan.any():
        return chunk
    chunk = chunk.copy()
    chunk[is_nan] = nan
    return chunk


def _engine_bits(tensor: torch.Tensor, dtype: torch.dtype | None):
    """(flat bits of tensor as an int array, a function turning a slice of them into the bits in dtype, one NaN)."""
    tensor = tensor.detach()
    target = tensor.dtype if dtype is None else dtype
    if target == tensor.dtype:
        flat = bits(tensor.contiguous()).numpy()
    elif tensor.dtype == torch.float32 and target == torch.bfloat16:  # the usual fp32 trainer, bf16 engine: in numpy
        return bits(tensor.contiguous()).numpy(), _bf16_bits  # its NaNs already the one NaN
    else:
        flat = bits(tensor.to(target).contiguous()).numpy()
    return flat, lambda chunk: _one_nan(chunk, target)


def checksum(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    """The exact checksum of tensor (in dtype, where given): its bits (flat, row-major) weighted by position, summed
    modulo 2**64 (as a signed int64). In numpy, single-threaded, a chunk at a time: torch's intra-op threads wait for
    each other at every op, which on a busy machine (rollout workers beside the trainer) made the same loop 10-100x
    slower with 2 threads than with 1, and so did converting the weights to bf16 (done here per chunk instead)."""
    if tensor.device.type != "cpu":
        return device_checksum(tensor, dtype)
    flat, convert = _engine_bits(tensor, dtype)  # (n,) integers of the element width
    total = 0
    step = _COLUMNS * _CHUNK_ROWS
    with np.errstate(over="ignore"):  # wrapping int64 arithmetic is the point
        for start in range(0, flat.size, step):
            chunk = convert(flat[start : start + step]).astype(np.int64)
            pad = -chunk.size % _COLUMNS
            if pad:
                chunk = np.concatenate([chunk, np.zeros(pad, dtype=np.int64)])
            rows = chunk.reshape(-1, _COLUMNS)  # (r, C)
            row_sums = (rows * _COLUMN_MULTIPLIERS).sum(1, dtype=np.int64)  # (r,), wrapping
            weighted = row_sums * _multipliers(start // _COLUMNS, rows.shape[0], _ROW_MUL, _ROW_ADD)
            total = (total + int(weighted.sum(dtype=np.int64))) & _MASK
    return total - (1 << 64) if total >> 63 else total


_DEVICE_CHUNK = 1 << 24  # elements at a time on a device (128 MiB of int64 temporaries)


def device_checksum(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    """checksum's value computed with torch where the tensor is (a GPU engine's weights: no copy to the host, and no
    busy CPU threads to wait for); the same arithmetic, so the same int on any device (modular sums do not depend
    on the order a GPU reduces in)."""
    t = tensor.detach()
    t = t if dtype is None or dtype == t.dtype else t.to(dtype)
    flat = bits(t.contiguous())  # (n,)
    if t.dtype in _NAN_BITS:
        magnitude, inf, nan = _NAN_BITS[t.dtype]
        flat = torch.where((flat & magnitude) > inf, torch.full_like(flat, nan), flat)
    columns = torch.from_numpy(_COLUMN_MULTIPLIERS).to(t.device)
    total = 0
    for start in range(0, flat.numel(), _DEVICE_CHUNK):
        chunk = flat[start : start + _DEVICE_CHUNK].to(torch.int64)
        pad = -chunk.numel() % _COLUMNS
        if pad:
            chunk = torch.cat([chunk, chunk.new_zeros(pad)])
        rows = chunk.view(-1, _COLUMNS)  # (r, C)
        row_mults = torch.from_numpy(_multipliers(start // _COLUMNS, rows.shape[0], _ROW_MUL, _ROW_ADD)).to(t.device)
        total = (total + int(((rows * columns).sum(1) * row_mults).sum())) & _MASK
    return total - (1 << 64) if total >> 63 else total


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
        out.tensors[name] = TensorPrint(tuple(tensor.shape), checksum(tensor, dtype))
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
    """fingerprint(state_dict, dtype), or None where dtype is (verification off: print_dtype). A LoRA publish's
    fingerprint is its adapter's (a worker checks the adapter that arrived, then its engine against its own merge)."""
    if dtype is None:
        return None
    return fingerprint(state_dict.adapter if isinstance(state_dict, LoraPublish) else state_dict, dtype)
