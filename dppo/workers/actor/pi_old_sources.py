"""Where pi_old's log-probs come from on one rank: one PiOldSource per value of PiOldChoice.source (dppo.config.pi_old).

    behav      BehavSource: the behavior log-probs that came with the samples; no recompute, no snapshot.
    live       LiveSource: pi_old is the live weights at every trigger (prox_anchor=current, or parameter_sync_step=1,
               where slot 0 would never be read), so its log-probs are the training forward pass's own, detached
               (compute returns None: no pass of its own).
    slot       SlotSource: Decoupled PPO, every trigger uses the weights of the cycle start. Trigger 0 saves the live
               weights into snapshot slot 0 asynchronously and returns None: pi_old is the live weights, whose
               log-probs the training forward pass gives (the copy and that pass only read the weights; pool.guard
               fences the first optimizer step on the copy); trigger k >= 1 scores with slot 0 through a slot reader
               (view, stream or swap, dppo.workers.actor.slot_readers) chosen by snapshot.strategy, leaving the live
               weights alone.
    reference  ReferenceSource: snapshot.strategy=reference, for comparison only: verl v1's scheme of blocking
               per-parameter pageable copies (save at trigger 0; save, restore, forward, restore, clear at k >= 1).
    none       NoSource: loglinear approximates pi_old at every trigger from the training forward; nothing is scored.

None from compute means "no separate pass": the update takes log pi_old from its own forward pass (the prox method,
dppo.workers.actor.prox_method). Where the rollout correction needs the whole mini-batch's old log-probs before the
first backward pass, fuse_live is False (PiOldChoice.fuse_live) and the live-weight triggers run a no-grad pass of
their own. A source only computes; the provider (dppo.workers.actor.pi_old) decides when it is asked.

An exception in any source propagates and leaves the live weights and the optimizer state as they were.

Under FSDP2 (a sharded model, dppo.workers.actor.fsdp) every source runs rank-locally on the rank's own shards; slot 0
holds the local shards. FSDP2 all-gathers from the storage it registered, not from what a forward pass is handed,
so view (functional_call over the slot) and stream (the slot substituted block by block) would silently compute
with the live weights there: they are refused (dppo.pi_old_names.SHARDED_STRATEGIES lists what works), and auto
reads with swap, which writes slot 0 into that very storage and back.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from dppo import snapshot
from dppo.algo import UnknownNameError
from dppo.batch import TrainBatch
from dppo.config.pi_old import PiOldChoice
from dppo.pi_old_names import check_strategy_for_sharding
from dppo.workers.actor.fsdp import is_sharded, local_tensor
from dppo.workers.actor.slot_readers import SLOT_READERS, ScoreFn, SlotReader, StreamReader, choose_reader


class UnknownReaderError(UnknownNameError):
    """A slot-reader name that is not registered (the message lists the valid names)."""


class PiOldSource(ABC):
    """Computes log pi_old (B, R) for the trigger-th optimizer step of a sync cycle, or None where the training
    forward pass gives them (see the module docstring)."""

    name = ""

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, score: ScoreFn, choice: PiOldChoice
    ) -> None:
        self.model, self.optimizer, self.score = model, optimizer, score
        self.fuse_live = (
            choice.fuse_live
        )  # where pi_old is the live weights: the training forward's log-probs, or a pass
        self.snapshot_s = 0.0  # seconds spent in snapshot calls since the last take_snapshot_s()
        self.moved_bytes = 0  # weight bytes copied by snapshot work so far (saves, swaps, streamed steps, restores)

    @property
    def pool(self) -> snapshot.SnapshotPool | None:
        """The SnapshotPool in use, or None if this source takes no snapshot."""
        return None

    @abstractmethod
    def compute(self, trigger: int, batch: TrainBatch) -> torch.Tensor | None:
        """log pi_old (B, R) of batch at the trigger, or None: the training forward pass's own."""

    def live(self, batch: TrainBatch) -> torch.Tensor | None:
        """pi_old is the live weights: None (the training forward pass's log-probs), or a no-grad pass where
        fuse_live is off."""
        return None if self.fuse_live else self.score(self.model, batch, None)

    def skip_snapshot(self) -> None:
        """The cycle about to start reads no slot (every later mini-batch was scored ahead): its trigger 0 takes no
        snapshot. A source that takes none has nothing to skip."""

    def skip_cycle(self) -> None:
        """This cycle uses no pi_old weights at all (prox_logp_method=auto between its checks): nothing is saved,
        and what an earlier cycle saved is never handed out as this one's. Called at its trigger 0, instead of
        compute."""

    def take_snapshot_s(self) -> float:
        """Seconds spent in snapshot calls since the last call."""
        seconds, self.snapshot_s = self.snapshot_s, 0.0
        return seconds

    def anchor_weights(self) -> dict[str, torch.Tensor] | None:
        """pi_old's weights as CPU tensors where they differ from the live ones mid-cycle (for a mid-cycle
        checkpoint; a sharded model's local shards); None where pi_old needs no weights of its own."""
        return None

    def load_anchor(self, weights: dict[str, torch.Tensor]) -> None:
        """Make weights (from anchor_weights()) pi_old for the rest of the current cycle."""

    def close(self) -> None:
        """Release the snapshot memory."""


def trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters pi_old is made of: those that require grad (every one of a fully trained model; LoRA's adapters
    beside a frozen base, which no step changes)."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def with_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], fn: Callable[[], object]) -> object:
    """fn() while model's parameters hold weights; the live values are put back afterwards, also if fn raises.

    weights are what anchor_weights() returns: a sharded model's local shards (written into the storage FSDP2
    gathers from), else whole tensors."""
    params = {name: local_tensor(p) for name, p in trainable_parameters(model)}
    missing = [name for name in params if name not in weights]
    if missing:
        raise KeyError(f"pi_old's weights lack {len(missing)} trainable tensor(s), first {missing[0]!r}")
    live = {name: p.detach().clone() for name, p in params.items()}
    try:
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(weights[name])
        return fn()
    finally:
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(live[name])


class BehavSource(PiOldSource):
    name = "behav"

    def compute(self, trigger: int, batch: TrainBatch) -> torch.Tensor:
        return batch.behav_logp


class LiveSource(PiOldSource):
    name = "live"

    def compute(self, trigger: int, batch: TrainBatch) -> torch.Tensor | None:
        return self.live(batch)


class NoSource(PiOldSource):
    """loglinear: no snapshot, no pass; the update approximates log pi_old from its own forward pass
    (dppo.workers.actor.prox_method.loglinear_prox). The provider never asks it for old log-probs."""

    name = "none"

    def compute(self, trigger: int, batch: TrainBatch) -> None:
        return None


class SlotSource(PiOldSource):
    name = "slot"

    def __init__(self, model, optimizer, score, choice: PiOldChoice) -> None:
        super().__init__(model, optimizer, score, choice)
        # the trainable parameters only: a frozen base (LoRA) is the same at every trigger
        self._pool = snapshot.SnapshotPool(model, device_budget_bytes=choice.device_budget_bytes, trainable_only=True)
        # The save at trigger 0 is asynchronous: the first optimizer step must not overwrite a weight
        # before the copy has read it.
        self._guard = self._pool.guard(optimizer)
        self.sharded = is_sharded(model)
        # One reader of each kind over this pool: the stream reader keeps its traced schedule between reads.
        self._readers = {name: cls(self) for name, cls in SLOT_READERS.items()}
        self.use_reader(choice.reader)
        self._skip_next = False  # skip_snapshot() was called: the next trigger 0 takes no snapshot
        self._slot_is_pi_old = False  # slot 0 holds this cycle's pi_old (a cycle that skipped it holds an older one)

    @property
    def pool(self) -> snapshot.SnapshotPool:
        return self._pool

    @property
    def device_type(self) -> str:
        """Where the live weights are: "cpu" or "cuda"."""
        return next(self.model.parameters()).device.type

    @property
    def reader_name(self) -> str:
        """The reader triggers k >= 1 use ("auto" until auto has chosen one)."""
        return "auto" if self._reader is None else self._reader.name

    @property
    def _stream_reader(self) -> StreamReader:
        return self._readers["stream"]

    @property
    def stream(self):
        """The stream reader's StreamedWeights over slot 0 (None until traced, or where it cannot stream)."""
        return self._stream_reader.stream

    @property
    def stream_error(self) -> str | None:
        """Why the model cannot be streamed, once a trace or a streamed pass has failed."""
        return self._stream_reader.stream_error

    def use_reader(self, name: str) -> None:
        """Read slot 0 at triggers k >= 1 with SLOT_READERS[name] ("auto": chosen at the first read, and
        again whenever slot 0 has moved to another tier since). A sharded model allows SHARDED_STRATEGIES only."""
        if name != "auto" and name not in SLOT_READERS:
            raise UnknownReaderError(f"unknown slot reader {name!r}; valid names: {', '.join(SLOT_READERS)}")
        if self.sharded:
            check_strategy_for_sharding(name)
        self._reader: SlotReader | None = None if name == "auto" else self._readers[name]
        self._auto = name == "auto"
        self._reader_tier: str | None = None  # the tier of slot 0 that auto chose the reader for

    def _choose_reader(self, batch: TrainBatch, tier: str) -> SlotReader:
        name = choose_reader(self.device_type, tier, lambda: self._stream_reader.streamable(batch), self.sharded)
        self._reader_tier = tier
        return self._readers[name]

    def skip_snapshot(self) -> None:
        self._skip_next = True

    def skip_cycle(self) -> None:  # slot 0 still holds an earlier cycle's pi_old: never hand it out as this one's
        self._slot_is_pi_old, self._skip_next = False, False

    def compute(self, trigger: int, batch: TrainBatch) -> torch.Tensor | None:
        if trigger == 0:
            self._slot_is_pi_old, self._skip_next = not self._skip_next, False
            if self._slot_is_pi_old:
                start = time.perf_counter()
                self._pool.save(0)  # returns at once; the copy reads the weights while the training forward runs
                self.snapshot_s += time.perf_counter() - start
                self.moved_bytes += self._pool.nbytes
            return self.live(batch)
        if 0 not in self._pool:
            raise RuntimeError(f"trigger {trigger}: snapshot slot 0 is empty; trigger 0 of the cycle must run first")
        if not self._slot_is_pi_old:
            raise RuntimeError(
                f"trigger {trigger}: this cycle took no snapshot (skip_snapshot: every later mini-batch "
                "was to be scored ahead), so slot 0 does not hold its pi_old"
            )
        if self._auto:  # a save may land in another tier than the last one (device budget taken meanwhile)
            tier = self._pool.tier(0)
            if self._reader is None or tier != self._reader_tier:
                self._reader = self._choose_reader(batch, tier)
        read = self._reader.read(batch)
        self.snapshot_s += read.snapshot_s
        self.moved_bytes += read.moved_bytes
        return read.logp

    def anchor_weights(self) -> dict[str, torch.Tensor] | None:
        if 0 not in self._pool or not self._slot_is_pi_old:
            return None  # a cycle scored wholly ahead needs no pi_old weights: its old log-probs are kept
        self._pool.synchronize()
        return {name: t.to("cpu", copy=True) for name, t in self._pool.view(0).items()}

    def load_anchor(self, weights: dict[str, torch.Tensor]) -> None:
        def save():
            self._pool.save(0)
            self._pool.synchronize()

        with_weights(self.model, weights, save)
        self._slot_is_pi_old = True

    def close(self) -> None:
        self._guard.remove()
        if 0 in self._pool:
            self._pool.fence()
            self._pool.clear(0)


class ReferenceSource(PiOldSource):
    """The reference (verl v1) scheme, re-created for comparison only (snapshot.strategy=reference).

    Trigger 0: blocking per-parameter pageable save of the live weights (a sharded model's local shards) into
    a dict slot; the old log-probs are the training forward pass's (as every source's where pi_old is live).
    Trigger k >= 1: save the live weights into a temporary dict, restore slot 0 into the live parameters
    (per-parameter .to(device) + copy_), the forward pass, restore the live weights, clear the temporary dict:
    three full weight transfers, none overlapped with anything.
    """

    name = "reference"

    def __init__(self, model, optimizer, score, choice: PiOldChoice) -> None:
        super().__init__(model, optimizer, score, choice)
        self._slot: dict[str, torch.Tensor] | None = None
        self._nbytes = sum(local_tensor(p).nbytes for _, p in trainable_parameters(model))
        self.moved_bytes_per_copy = self._nbytes  # one slot's bytes (the rank's snapshot/bytes)

    def _save(self) -> dict[str, torch.Tensor]:
        self.moved_bytes += self._nbytes
        return {name: local_tensor(p).detach().to("cpu", copy=True) for name, p in trainable_parameters(self.model)}

    @torch.no_grad()
    def _restore(self, state: dict[str, torch.Tensor]) -> None:
        self.moved_bytes += self._nbytes
        for name, p in trainable_parameters(self.model):
            local_tensor(p).copy_(state[name].to(p.device))  # in place: a shard's storage is what FSDP2 gathers

    def compute(self, trigger: int, batch: TrainBatch) -> torch.Tensor | None:
        start = time.perf_counter()
        if trigger == 0:
            self._slot = self._save()
            self.snapshot_s += time.perf_counter() - start
            return self.live(batch)
        if self._slot is None:
            raise RuntimeError(f"trigger {trigger}: the reference slot 0 is empty; trigger 0 of a cycle comes first")
        live = self._save()
        forward_s = 0.0
        try:
            self._restore(self._slot)
            forward_start = time.perf_counter()
            logp = self.score(self.model, batch, None)
            forward_s = time.perf_counter() - forward_start
        finally:
            self._restore(live)
            live.clear()
            self.snapshot_s += time.perf_counter() - start - forward_s
        return logp

    def anchor_weights(self) -> dict[str, torch.Tensor] | None:
        return None if self._slot is None else {name: t.clone() for name, t in self._slot.items()}

    def load_anchor(self, weights: dict[str, torch.Tensor]) -> None:
        self._slot = {name: t.to("cpu", copy=True) for name, t in weights.items()}

    def close(self) -> None:
        self._slot = None


# one source class per name of dppo.pi_old_names.SOURCES
PI_OLD_SOURCES: dict[str, type[PiOldSource]] = {
    cls.name: cls for cls in (BehavSource, LiveSource, SlotSource, ReferenceSource, NoSource)
}
