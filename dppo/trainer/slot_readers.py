"""How trigger k >= 1 of a Decoupled PPO cycle scores with snapshot slot 0 without touching the live weights.

    view    torch.func.functional_call over pool.view(0): the slot's tensors feed the model directly. Zero
            copies when the slot lives where the model computes (CPU weights, or a device-tier slot).
    stream  the model's own graph runs block by block over slot 0 streamed through the engine's two staging
            buffers (dppo.trainer.streaming): one transfer of the weights per micro-batch pass, hidden
            behind the compute; no save or restore of the live weights. Falls back to swap if the model's
            forward pass cannot be split into blocks.
    swap    `with pool.swapped(0)`: the live weights go to scratch and slot 0 comes in, and back on exit.

choose_reader() is what snapshot.strategy=auto picks: the fastest reader that fits where the slot is.
A reader is reader(strategy, batch) -> log pi_old (B, R); it adds the host seconds of its snapshot calls to
strategy.snapshot_s and the bytes it copies to strategy.moved_bytes.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from dppo._errors import SnapshotMemoryError
from dppo.models import forward_logits
from dppo.rollout import TrainBatch
from dppo.trainer.streaming import NotStreamableError, StreamedWeights, StreamOrderError, trace_schedule

if TYPE_CHECKING:
    from dppo.trainer.prox import CycleStartOldLogProb


def choose_reader(device_type: str, slot_tier: str, streamable: Callable[[], bool], sharded: bool = False) -> str:
    """snapshot.strategy=auto: view where the slot's tensors can feed the model in place, else stream, else swap.

    device_type: where the live weights are ("cpu", "cuda"); slot_tier: pool.tier(0) ("host" or "device");
    streamable(): whether the model's forward pass splits into blocks (only asked when it matters);
    sharded: an FSDP2 model, which all-gathers from its own storage: only swap is exact there (dppo.trainer.prox).
    """
    if sharded:
        return "swap"
    if slot_tier == "device" or device_type == "cpu":
        return "view"  # zero transfers: the slot is already where the model computes
    return "stream" if streamable() else "swap"


def read_view(strategy: CycleStartOldLogProb, batch: TrainBatch) -> torch.Tensor:
    """functional_call over the slot's tensors: no copy of the live weights, nothing to put back."""
    pool = strategy.pool
    device_type = strategy.device_type
    if device_type != "cpu" and pool.tier(0) != "device":
        raise ValueError(
            f"snapshot.strategy=view needs slot 0 where the model computes, but the model is on {device_type!r} "
            f"and slot 0 on the host ({pool.nbytes} bytes > the free snapshot.device_budget_bytes); "
            "use snapshot.strategy=auto, stream or swap, or raise snapshot.device_budget_bytes"
        )
    start = time.perf_counter()
    params = pool.view(0)
    strategy.snapshot_s += time.perf_counter() - start
    return strategy.score(strategy.model, batch, params)


def read_swap(strategy: CycleStartOldLogProb, batch: TrainBatch) -> torch.Tensor:
    """Swap slot 0 into the live tensors around the forward pass; the pool swaps them back, also on error."""
    start = time.perf_counter()
    with strategy.pool.swapped(0):
        forward_start = time.perf_counter()
        logp = strategy.score(strategy.model, batch, None)
        forward_s = time.perf_counter() - forward_start
    strategy.snapshot_s += time.perf_counter() - start - forward_s  # the two swaps
    strategy.moved_bytes += 3 * strategy.pool.nbytes  # live -> scratch, slot -> live, scratch -> live
    return logp


def stream_of(strategy: CycleStartOldLogProb, batch: TrainBatch) -> StreamedWeights | None:
    """The strategy's StreamedWeights over slot 0, traced on batch's first sequence at the first call;
    None if the model's forward pass cannot be streamed (the reason is kept in strategy.stream_error)."""
    if strategy.stream is None and strategy.stream_error is None:
        try:
            mask = None if batch.attention_mask is None else batch.attention_mask[:1]
            schedule = trace_schedule(strategy.model, lambda: forward_logits(strategy.model, batch.input_ids[:1],
                                                                             attention_mask=mask))  # fmt: skip
        except NotStreamableError as err:
            strategy.stream_error = str(err)
        else:
            strategy.stream = StreamedWeights(strategy.pool.streamer(0, schedule.steps), schedule)
    return strategy.stream


def read_stream(strategy: CycleStartOldLogProb, batch: TrainBatch) -> torch.Tensor:
    """Score with slot 0 streamed block by block (one StreamedWeights pass per micro-batch)."""
    stream = stream_of(strategy, batch)
    if stream is None:
        return _fall_back_to_swap(strategy, batch, f"the model cannot be streamed ({strategy.stream_error})")
    host_s, moved = stream.host_s, stream.moved_bytes
    try:
        logp = strategy.score(strategy.model, batch, stream)
    except (StreamOrderError, SnapshotMemoryError) as err:  # swap needs no device memory beyond the model's
        strategy.stream, strategy.stream_error = None, str(err)
        return _fall_back_to_swap(strategy, batch, str(err))
    finally:
        strategy.snapshot_s += stream.host_s - host_s
        strategy.moved_bytes += stream.moved_bytes - moved
    return logp


def _fall_back_to_swap(strategy: CycleStartOldLogProb, batch: TrainBatch, why: str) -> torch.Tensor:
    warnings.warn(f"snapshot reader 'stream': {why}; using 'swap' from now on", RuntimeWarning, stacklevel=3)
    strategy.use_reader("swap")
    return read_swap(strategy, batch)


SLOT_READERS: dict[str, Callable[[CycleStartOldLogProb, TrainBatch], torch.Tensor]] = {
    "view": read_view,
    "swap": read_swap,
    "stream": read_stream,
}
