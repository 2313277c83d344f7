"""Old (proximal) log-probs of a sync cycle: a small registry of strategies, chosen once per run.

    bypass       old := behavior log-probs that came with the samples; no recompute, no snapshot.
    current      AReaL's prox_anchor=current: pi_old is the live weights at every trigger, so the old log-probs
                 are the training forward pass's own, detached (compute returns None: no pass of its own).
                 Also used for cycle_start when parameter_sync_step == 1 (slot 0 would never be read).
    cycle_start  Decoupled PPO: every trigger uses the weights of the cycle start. Trigger 0 saves the live
                 weights into snapshot slot 0 asynchronously and returns None: pi_old is the live weights, whose
                 log-probs the training forward pass gives (the copy and that pass only read the weights;
                 pool.guard fences the first optimizer step on the copy); trigger k >= 1 scores with slot 0
                 through a slot reader (view, stream or swap, see dppo.workers.actor.slot_readers) chosen by
                 snapshot.strategy, leaving the live weights alone.
    cycle_start_reference
                 snapshot.strategy=reference, for comparison only: verl v1's scheme of blocking per-parameter
                 pageable copies (save at trigger 0; save, restore, forward, restore, clear at k >= 1).
    loglinear    algorithm.prox_logp_method=loglinear: no snapshot and no pass; the old log-probs are
                 approximated from the training forward's (dppo.workers.actor.prox_method), so compute returns None.
    auto         algorithm.prox_logp_method=auto: cycle_start on check cycles, loglinear's nothing between.

None from compute means "no separate pass": the update takes log pi_old from its own forward pass
(dppo.workers.actor.prox_method). Where an option needs the whole mini-batch's old log-probs before the first
backward pass (needs_whole_mini_batch), fuse_live is False and the live-weight triggers run a no-grad pass of
their own, as before. After the update, record_used(batch, prox_logp) hands the strategy the old log-probs the
loss used (trainer.verify_old_log_prob compares those).

New readers register in SLOT_READERS; new strategies in OLD_LOG_PROB_STRATEGIES. An exception in any
strategy propagates and leaves the live weights and the optimizer state as they were.

Under FSDP2 (a sharded model, dppo.workers.actor.fsdp) every strategy runs rank-locally on the rank's own shards;
slot 0 holds the local shards. FSDP2 all-gathers from the storage it registered, not from what a forward
pass is handed, so view (functional_call over the slot) and stream (the slot substituted block by block)
would silently compute with the live weights there: they are refused (SHARDED_READERS lists what works), and
auto reads with swap, which writes slot 0 into that very storage and back.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch

from dppo.algo import UnknownNameError
from dppo.config.choices import check_reader_for_sharding, needs_whole_mini_batch, select_strategy_name
from dppo.batch import TrainBatch
from dppo import snapshot
from dppo.workers.actor.fsdp import is_sharded, local_tensor
from dppo.workers.actor.slot_readers import SLOT_READERS, ScoreFn, SlotReader, StreamReader, choose_reader


class UnknownStrategyError(UnknownNameError):
    """A strategy or slot-reader name that is not registered (the message lists the valid names)."""


class OldLogProbStrategy:
    """Computes log pi_old (B, R) for the trigger-th optimizer step of a sync cycle, or None where the training
    forward pass gives them (see the module docstring)."""

    name = ""
    anchor: str | None = None  # whose weights pi_old is: "cycle_start", "current", or None (behavior policy)
    moved_bytes = 0  # weight bytes copied by snapshot work so far (saves, swaps, streamed steps, restores)

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, score: ScoreFn, cfg):
        self.model, self.optimizer, self.score, self.cfg = model, optimizer, score, cfg
        self.snapshot_s = 0.0  # seconds spent in snapshot calls since the last take_snapshot_s()
        # None where pi_old is the live weights (the training forward's log-probs); False: a no-grad pass instead
        self.fuse_live = not needs_whole_mini_batch(cfg)

    @property
    def pool(self):
        """The SnapshotPool in use, or None if this strategy takes no snapshot."""
        return None

    def compute(self, trigger: int, batch: TrainBatch) -> torch.Tensor | None:
        raise NotImplementedError

    def live(self, batch: TrainBatch) -> torch.Tensor | None:
        """pi_old is the live weights: None (the training forward pass's log-probs), or a no-grad pass where
        fuse_live is off."""
        return None if self.fuse_live else self.score(self.model, batch, None)

    def record_used(self, batch: TrainBatch, prox_logp: torch.Tensor) -> None:
        """Called after the update with the old log-probs (B, R) its loss used."""

    def scored_ahead(self, trigger: int, batch: TrainBatch, prox_logp: torch.Tensor) -> torch.Tensor:
        """log pi_old (B, R) of trigger's mini-batch, scored ahead by the driver (dppo.trainer.score_ahead) with the
        live weights before trigger 0's optimizer step, which are pi_old: used as they are, no slot read."""
        return prox_logp

    def skip_snapshot(self) -> None:
        """The cycle about to start reads no slot (every later mini-batch was scored ahead): its trigger 0 takes no
        snapshot. A strategy that takes none has nothing to skip."""

    def take_snapshot_s(self) -> float:
        """Seconds spent in snapshot calls since the last call."""
        seconds, self.snapshot_s = self.snapshot_s, 0.0
        return seconds

    def end_cycle(self) -> dict[str, float]:
        """Called once the cycle's last trigger is done; metrics of the cycle to log."""
        return {}

    def anchor_weights(self) -> dict[str, torch.Tensor] | None:
        """pi_old's weights as CPU tensors where they differ from the live ones mid-cycle (for a mid-cycle
        checkpoint; a sharded model's local shards); None where pi_old needs no weights of its own."""
        return None

    def load_anchor(self, weights: dict[str, torch.Tensor]) -> None:
        """Make weights (from anchor_weights()) pi_old for the rest of the current cycle."""

    def load_published(self, weights: dict[str, torch.Tensor], build: Callable[[dict], torch.nn.Module]) -> None:
        """pi_old's whole weights as they were published (a mid-cycle checkpoint that kept none on the ranks); build
        makes a plain module holding them. Only a verifier needs them (its reference copy)."""

    def state(self) -> dict:
        """What a mid-cycle checkpoint must keep of this strategy besides pi_old's weights (plain values)."""
        return {}

    def load_state(self, state: dict) -> None:
        """Continue from state() of a checkpointed run ({}: nothing kept)."""

    def close(self) -> None:
        pass


def with_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], fn: Callable[[], object]) -> object:
    """fn() while model's parameters hold weights; the live values are put back afterwards, also if fn raises.

    weights are what anchor_weights() returns: a sharded model's local shards (written into the storage FSDP2
    gathers from), else whole tensors."""
    params = {name: local_tensor(p) for name, p in model.named_parameters()}
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


class BypassOldLogProb(OldLogProbStrategy):
    name = "bypass"

    def compute(self, trigger: int, batch: TrainBatch) -> torch.Tensor:
        return batch.behav_logp


class CurrentOldLogProb(OldLogProbStrategy):
    name = "current"
    anchor = "current"

    def compute(self, trigger: int, batch: TrainBatch) -> torch.Tensor | None:
        return self.live(batch)


class LoglinearOldLogProb(OldLogProbStrategy):
    """algorithm.prox_logp_method=loglinear: no snapshot, no pass; the update approximates log pi_old from its
    own forward pass (dppo.workers.actor.prox_method.loglinear_prox)."""

    name = "loglinear"
    anchor = "cycle_start"  # what it approximates

    def compute(self, trigger: int, batch: TrainBatch) -> None:
        return None


def _lookup(registry: dict, name: str, what: str):
    try:
        return registry[name]
    except KeyError:
        raise UnknownStrategyError(f"unknown {what} {name!r}; valid names: {', '.join(registry)}") from None


class CycleStartOldLogProb(OldLogProbStrategy):
    name = "cycle_start"
    anchor = "cycle_start"

    def __init__(self, model, optimizer, score, cfg, reader: str | None = None):
        super().__init__(model, optimizer, score, cfg)
        self._pool = snapshot.SnapshotPool(model, device_budget_bytes=cfg.snapshot.device_budget_bytes)
        # The save at trigger 0 is asynchronous: the first optimizer step must not overwrite a weight
        # before the copy has read it.
        self._guard = self._pool.guard(optimizer)
        self.sharded = is_sharded(model)
        # One reader of each kind over this pool: the stream reader keeps its traced schedule between reads.
        self._readers = {name: cls(self) for name, cls in SLOT_READERS.items()}
        self.use_reader(reader or cfg.snapshot.strategy)
        self._skip_next = False  # skip_snapshot() was called: the next trigger 0 takes no snapshot
        self._slot_is_pi_old = False  # slot 0 holds this cycle's pi_old (a cycle that skipped it holds an older one)

    @property
    def pool(self):
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
        again whenever slot 0 has moved to another tier since). A sharded model allows SHARDED_READERS only."""
        if name != "auto":
            _lookup(SLOT_READERS, name, "slot reader")  # an unknown name is refused, listing the valid ones
        if self.sharded:
            check_reader_for_sharding(name)
        self._reader: SlotReader | None = None if name == "auto" else self._readers[name]
        self._auto = name == "auto"
        self._reader_tier: str | None = None  # the tier of slot 0 that auto chose the reader for

    def _choose_reader(self, batch: TrainBatch, tier: str) -> SlotReader:
        name = choose_reader(self.device_type, tier, lambda: self._stream_reader.streamable(batch), self.sharded)
        self._reader_tier = tier
        return self._readers[name]

    def skip_snapshot(self) -> None:
        self._skip_next = True

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
            raise RuntimeError(f"trigger {trigger}: this cycle took no snapshot (skip_snapshot: every later mini-batch "
                               "was to be scored ahead), so slot 0 does not hold its pi_old")  # fmt: skip
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


class AutoOldLogProb(CycleStartOldLogProb):
    """algorithm.prox_logp_method=auto: cycle_start on the cycles the switch (dppo.workers.actor.prox_auto, shared
    with the prox method) checks; on the cycles that run loglinear no snapshot and no pass (compute returns None)."""

    name = "auto"
    switch = None  # the AutoProxSwitch; the rank sets it (None: every cycle is exact)

    def compute(self, trigger: int, batch: TrainBatch) -> torch.Tensor | None:
        if self.switch is not None and not self.switch.is_check_cycle():
            if trigger == 0:  # slot 0 still holds the last check cycle's pi_old: never hand it out as this one's
                self._slot_is_pi_old, self._skip_next = False, False
            return None
        return super().compute(trigger, batch)


class ReferenceCycleStartOldLogProb(OldLogProbStrategy):
    """The reference (verl v1) scheme, re-created for comparison only (snapshot.strategy=reference).

    Trigger 0: blocking per-parameter pageable save of the live weights (a sharded model's local shards) into
    a dict slot; the old log-probs are the training forward pass's (as every strategy's where pi_old is live).
    Trigger k >= 1: save the live weights into a temporary dict, restore slot 0 into the live parameters
    (per-parameter .to(device) + copy_), the forward pass, restore the live weights, clear the temporary dict:
    three full weight transfers, none overlapped with anything.
    """

    name = "cycle_start_reference"
    anchor = "cycle_start"

    def __init__(self, model, optimizer, score, cfg):
        super().__init__(model, optimizer, score, cfg)
        self._slot: dict[str, torch.Tensor] | None = None
        self._nbytes = sum(local_tensor(p).nbytes for p in model.parameters())

    def _save(self) -> dict[str, torch.Tensor]:
        self.moved_bytes += self._nbytes
        return {name: local_tensor(p).detach().to("cpu", copy=True) for name, p in self.model.named_parameters()}

    @torch.no_grad()
    def _restore(self, state: dict[str, torch.Tensor]) -> None:
        self.moved_bytes += self._nbytes
        for name, p in self.model.named_parameters():
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


OLD_LOG_PROB_STRATEGIES: dict[str, type[OldLogProbStrategy]] = {
    "bypass": BypassOldLogProb,
    "current": CurrentOldLogProb,
    "cycle_start": CycleStartOldLogProb,
    "cycle_start_reference": ReferenceCycleStartOldLogProb,
    "loglinear": LoglinearOldLogProb,
    "auto": AutoOldLogProb,
}

# ---------------------------------------------------------------------------------------------------
# Verification (trainer.verify_old_log_prob)
# ---------------------------------------------------------------------------------------------------


class VerifiedOldLogProb(OldLogProbStrategy):
    """Wraps a strategy; scores every batch again with an independent copy of the anchor weights.

    copy_model(model) makes that copy (default copy.deepcopy; a sharded actor gathers its full weights into a
    plain module). end_cycle() reports debug/old_log_prob_max_abs_diff: the largest |old log-prob the loss used
    (record_used: a separate pass's, the training forward's own, detached, or one scored ahead) - the copy's|
    over the valid tokens of the cycle. A cycle resumed mid-way gets its copy from the checkpoint (the ranks' anchor,
    or the weights it was published as: load_published); one from a checkpoint of an older dppo that kept neither
    has none to check its scored-ahead old log-probs against: debug/old_log_prob_unverified counts those.
    """

    def __init__(self, inner: OldLogProbStrategy, copy_model: Callable[[torch.nn.Module], torch.nn.Module] = copy.deepcopy):
        if inner.anchor is None:
            raise ValueError(f"strategy {inner.name!r} does not recompute old log-probs; there is nothing to verify")
        super().__init__(inner.model, inner.optimizer, inner.score, inner.cfg)
        self.inner, self.copy_model = inner, copy_model
        self.name, self.anchor = inner.name, inner.anchor
        self.reference: torch.nn.Module | None = None
        self._expected: torch.Tensor | None = None  # (B, R) the reference's log-probs of the trigger's batch
        self.max_abs_diff = 0.0
        self.unverified = 0  # scored-ahead mini-batches of the cycle that had no reference to check against
        self._unverifiable = False  # the trigger's old log-probs were scored ahead and there is no reference

    @property
    def pool(self):
        return self.inner.pool

    @property
    def moved_bytes(self) -> int:
        return self.inner.moved_bytes

    def take_snapshot_s(self) -> float:
        return self.inner.take_snapshot_s()

    def compute(self, trigger: int, batch: TrainBatch) -> torch.Tensor | None:
        if trigger == 0 or self.anchor == "current":
            self.reference = self.copy_model(self.model)  # the anchor weights, independent of the snapshot
        # scored now, before the update moves the live weights; compared in record_used with what the loss used
        self._expected = self.score(self.reference, batch, None)
        return self.inner.compute(trigger, batch)

    def scored_ahead(self, trigger: int, batch: TrainBatch, prox_logp: torch.Tensor) -> torch.Tensor:
        # none to compare with in a cycle resumed mid-way that kept no pi_old weights (all of it scored ahead)
        self._expected = None if self.reference is None else self.score(self.reference, batch, None)
        self._unverifiable = self.reference is None
        return self.inner.scored_ahead(trigger, batch, prox_logp)

    def skip_snapshot(self) -> None:
        self.inner.skip_snapshot()

    def record_used(self, batch: TrainBatch, prox_logp: torch.Tensor) -> None:
        self.inner.record_used(batch, prox_logp)
        expected, self._expected = self._expected, None
        if expected is None and self._unverifiable:
            self.unverified, self._unverifiable = self.unverified + 1, False
            return
        if expected is None:
            raise RuntimeError("record_used without a compute before it: there is nothing to compare with")
        diff = (prox_logp - expected).abs()[batch.response_mask]
        if diff.numel():
            self.max_abs_diff = max(self.max_abs_diff, float(diff.max()))

    def anchor_weights(self) -> dict[str, torch.Tensor] | None:
        return self.inner.anchor_weights()

    def load_anchor(self, weights: dict[str, torch.Tensor]) -> None:
        self.inner.load_anchor(weights)
        if self.anchor == "cycle_start":
            self.reference = with_weights(self.model, weights, lambda: self.copy_model(self.model))

    def load_published(self, weights: dict[str, torch.Tensor], build: Callable[[dict], torch.nn.Module]) -> None:
        """The reference the rest of a resumed cycle (its mini-batches scored ahead) is checked against."""
        if self.anchor == "cycle_start":
            self.reference = build(weights)

    def state(self) -> dict:
        """The cycle's verification so far: a cycle resumed mid-way reports its whole cycle's largest difference."""
        return {**self.inner.state(), "max_abs_diff": self.max_abs_diff, "unverified": self.unverified}

    def load_state(self, state: dict) -> None:
        self.inner.load_state(state)
        self.max_abs_diff = float(state.get("max_abs_diff", 0.0))
        self.unverified = int(state.get("unverified", 0))

    def end_cycle(self) -> dict[str, float]:
        diff, self.max_abs_diff = self.max_abs_diff, 0.0
        metrics = {**self.inner.end_cycle(), "debug/old_log_prob_max_abs_diff": diff}
        if self.unverified:
            metrics["debug/old_log_prob_unverified"] = float(self.unverified)
            self.unverified = 0
        return metrics

    def close(self) -> None:
        self.inner.close()


def make_old_log_prob(model, optimizer, score: ScoreFn, cfg, name: str | None = None,
                      copy_model: Callable[[torch.nn.Module], torch.nn.Module] = copy.deepcopy) -> OldLogProbStrategy:  # fmt: skip
    """The strategy named name (default: select_strategy_name(cfg)), verified if trainer.verify_old_log_prob
    (with references made by copy_model)."""
    name = name or select_strategy_name(cfg)
    strategy = _lookup(OLD_LOG_PROB_STRATEGIES, name, "old-log-prob strategy")(model, optimizer, score, cfg)
    if cfg.trainer.verify_old_log_prob:
        strategy = VerifiedOldLogProb(strategy, copy_model)
    return strategy
