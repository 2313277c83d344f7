"""How trigger k >= 1 of a Decoupled PPO cycle scores with snapshot slot 0 without touching the live weights.

    view    torch.func.functional_call over pool.view(0): the slot's tensors feed the model directly. Zero
            copies when the slot lives where the model computes (CPU weights, or a device-tier slot).
    stream  the model's own graph runs block by block over slot 0 streamed through the engine's two staging
            buffers (dppo.workers.actor.streaming): one transfer of the weights per micro-batch pass, hidden
            behind the compute; no save or restore of the live weights. Falls back to swap if the model's
            forward pass cannot be split into blocks.
    swap    `with pool.swapped(0)`: the live weights go to scratch and slot 0 comes in, and back on exit.

choose_reader() is what snapshot.strategy=auto picks: the fastest reader that fits where the slot is.
A reader reads what it needs (the model, the pool, the score function, where the weights are) through the narrow
SlotOwner protocol, which the slot pi_old source (dppo.workers.actor.pi_old_sources.SlotSource) satisfies, and changes
none of it: read(batch) returns a
SlotRead, log pi_old (B, R) with the host seconds of its snapshot calls and the bytes it copied.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from dppo._errors import SnapshotMemoryError
from dppo.models import forward_logits
from dppo.batch import TrainBatch
from dppo.workers.actor.streaming import NotStreamableError, StreamedWeights, StreamOrderError, trace_schedule

# score(module, batch, params) -> log pi (B, R) fp32 without grad; params None means module's own weights.
ScoreFn = Callable[[torch.nn.Module, TrainBatch, "dict[str, torch.Tensor] | StreamedWeights | None"], torch.Tensor]


def choose_reader(device_type: str, slot_tier: str, streamable: Callable[[], bool], sharded: bool = False) -> str:
    """snapshot.strategy=auto: view where the slot's tensors can feed the model in place, else stream, else swap.

    device_type: where the live weights are ("cpu", "cuda"); slot_tier: pool.tier(0) ("host" or "device");
    streamable(): whether the model's forward pass splits into blocks (only asked when it matters);
    sharded: an FSDP2 model, which all-gathers from its own storage: only swap is exact there (dppo.workers.actor.pi_old_sources).
    """
    if sharded:
        return "swap"
    if slot_tier == "device" or device_type == "cpu":
        return "view"  # zero transfers: the slot is already where the model computes
    return "stream" if streamable() else "swap"


@dataclass
class SlotRead:
    logp: torch.Tensor  # log pi_old (B, R) fp32
    snapshot_s: float  # host seconds spent in snapshot calls (not in the forward pass)
    moved_bytes: int  # bytes the read copied


class SlotOwner(Protocol):
    """What a reader reads, at each read (dppo.workers.actor.pi_old_sources.SlotSource provides it)."""

    model: torch.nn.Module
    score: ScoreFn

    @property
    def pool(self): ...  # the SnapshotPool whose slot 0 holds pi_old

    @property
    def device_type(self) -> str: ...  # where the live weights are: "cpu" or "cuda"


class SlotReader:
    """Scores a batch with snapshot slot 0 of the source's pool over its model's graph, leaving the live weights
    alone."""

    name = ""

    def __init__(self, source: SlotOwner) -> None:
        self.source = source

    def read(self, batch: TrainBatch) -> SlotRead:
        raise NotImplementedError


class ViewReader(SlotReader):
    """functional_call over the slot's tensors: no copy of the live weights, nothing to put back."""

    name = "view"

    def read(self, batch: TrainBatch) -> SlotRead:
        src = self.source
        if src.device_type != "cpu" and src.pool.tier(0) != "device":
            raise ValueError(
                f"snapshot.strategy=view needs slot 0 where the model computes, but the model is on "
                f"{src.device_type!r} and slot 0 on the host ({src.pool.nbytes} bytes > the free "
                "snapshot.device_budget_bytes); use snapshot.strategy=auto, stream or swap, or raise "
                "snapshot.device_budget_bytes"
            )
        start = time.perf_counter()
        params = src.pool.view(0)
        snapshot_s = time.perf_counter() - start
        return SlotRead(src.score(src.model, batch, params), snapshot_s, 0)


class SwapReader(SlotReader):
    """Swaps slot 0 into the live tensors around the forward pass; the pool swaps them back, also on error."""

    name = "swap"

    def read(self, batch: TrainBatch) -> SlotRead:
        src = self.source
        start = time.perf_counter()
        with src.pool.swapped(0):
            forward_start = time.perf_counter()
            logp = src.score(src.model, batch, None)
            forward_s = time.perf_counter() - forward_start
        snapshot_s = time.perf_counter() - start - forward_s  # the two swaps
        return SlotRead(logp, snapshot_s, 3 * src.pool.nbytes)  # live -> scratch, slot -> live, scratch -> live


class StreamReader(SlotReader):
    """Scores with slot 0 streamed block by block (one StreamedWeights pass per micro-batch). Falls back to swap,
    for good, where the model cannot be streamed or a stream fails (name then reads "swap")."""

    name = "stream"

    def __init__(self, source: SlotOwner) -> None:
        super().__init__(source)
        self.stream: StreamedWeights | None = None  # traced on the first batch
        self.stream_error: str | None = None  # why the model cannot be streamed, once a trace or a pass has failed
        self._swap: SwapReader | None = None  # set once fallen back

    def streamable(self, batch: TrainBatch) -> bool:
        """Whether the model's forward pass streams; traced on batch's first sequence at the first call."""
        if self.stream is None and self.stream_error is None:
            model = self.source.model
            try:
                mask = None if batch.attention_mask is None else batch.attention_mask[:1]
                schedule = trace_schedule(
                    model, lambda: forward_logits(model, batch.input_ids[:1], attention_mask=mask)
                )
            except NotStreamableError as err:
                self.stream_error = str(err)
            else:
                self.stream = StreamedWeights(self.source.pool.streamer(0, schedule.steps), schedule)
        return self.stream is not None

    def read(self, batch: TrainBatch) -> SlotRead:
        if self._swap is not None:
            return self._swap.read(batch)
        if not self.streamable(batch):
            return self._fall_back(batch, f"the model cannot be streamed ({self.stream_error})")
        stream = self.stream
        host_s, moved = stream.host_s, stream.moved_bytes
        try:
            logp = self.source.score(self.source.model, batch, stream)
        except (StreamOrderError, SnapshotMemoryError) as err:  # swap needs no device memory beyond the model's
            self.stream, self.stream_error = None, str(err)
            fallen = self._fall_back(batch, str(err))
            return SlotRead(
                fallen.logp, fallen.snapshot_s + stream.host_s - host_s, fallen.moved_bytes + stream.moved_bytes - moved
            )
        return SlotRead(logp, stream.host_s - host_s, stream.moved_bytes - moved)

    def _fall_back(self, batch: TrainBatch, why: str) -> SlotRead:
        warnings.warn(f"snapshot reader 'stream': {why}; using 'swap' from now on", RuntimeWarning, stacklevel=4)
        self._swap = SwapReader(self.source)
        self.name = "swap"
        return self._swap.read(batch)


# one reader per name of dppo.pi_old_names.SLOT_READER_NAMES
SLOT_READERS: dict[str, type[SlotReader]] = {"view": ViewReader, "swap": SwapReader, "stream": StreamReader}
