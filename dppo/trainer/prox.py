"""Old (proximal) log-probs of a sync cycle: a small registry of strategies, chosen once per run.

    bypass       old := behavior log-probs that came with the samples; no recompute, no snapshot.
    current      AReaL's prox_anchor=current: recompute with the live weights before each optimizer step.
                 Also used for cycle_start when parameter_sync_step == 1 (slot 0 would never be read).
    cycle_start  Decoupled PPO: every trigger uses the weights of the cycle start. Trigger 0 saves the live
                 weights into snapshot slot 0 (asynchronously; pool.guard fences the first optimizer step
                 on that copy) and scores with the live weights; trigger k >= 1 scores with slot 0 through
                 a slot reader, leaving the live weights as they were.

Slot readers (SLOT_READERS) say how trigger k >= 1 reads slot 0: "view" runs torch.func.functional_call
over pool.view(0) (the live weights are never touched); "swap" runs inside `with pool.swapped(0)`.
"auto" picks view where the slot's tensors can feed the model directly (CPU weights, or a device-tier
slot) and swap otherwise. New readers register in SLOT_READERS; new strategies in
OLD_LOG_PROB_STRATEGIES. An exception in any strategy propagates and leaves the live weights and the
optimizer state as they were.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch

from dppo.rollout import TrainBatch

# score(module, batch, params) -> log pi (B, R) fp32 without grad; params None means module's own weights.
ScoreFn = Callable[[torch.nn.Module, TrainBatch, "dict[str, torch.Tensor] | None"], torch.Tensor]


class UnknownStrategyError(ValueError, KeyError):
    """A strategy or slot-reader name that is not registered (the message lists the valid names)."""

    def __str__(self) -> str:  # KeyError.__str__ would quote the message
        return str(self.args[0]) if self.args else ""


class OldLogProbStrategy:
    """Computes log pi_old (B, R) for the trigger-th optimizer step of a sync cycle."""

    name = ""
    anchor: str | None = None  # whose weights pi_old is: "cycle_start", "current", or None (behavior policy)

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, score: ScoreFn, cfg):
        self.model, self.optimizer, self.score, self.cfg = model, optimizer, score, cfg
        self.snapshot_s = 0.0  # seconds spent in snapshot calls since the last take_snapshot_s()

    @property
    def pool(self):
        """The SnapshotPool in use, or None if this strategy takes no snapshot."""
        return None

    def compute(self, trigger: int, batch: TrainBatch) -> torch.Tensor:
        raise NotImplementedError

    def take_snapshot_s(self) -> float:
        """Seconds spent in snapshot calls since the last call."""
        seconds, self.snapshot_s = self.snapshot_s, 0.0
        return seconds

    def end_cycle(self) -> None:
        pass

    def close(self) -> None:
        pass


class BypassOldLogProb(OldLogProbStrategy):
    name = "bypass"

    def compute(self, trigger: int, batch: TrainBatch) -> torch.Tensor:
        return batch.behav_logp


class CurrentOldLogProb(OldLogProbStrategy):
    name = "current"
    anchor = "current"

    def compute(self, trigger: int, batch: TrainBatch) -> torch.Tensor:
        return self.score(self.model, batch, None)


# ---------------------------------------------------------------------------------------------------
# Reading slot 0 at triggers k >= 1
# ---------------------------------------------------------------------------------------------------


def read_view(strategy: CycleStartOldLogProb, batch: TrainBatch) -> torch.Tensor:
    """functional_call over the slot's tensors: no copy of the live weights, nothing to put back."""
    return strategy.score(strategy.model, batch, strategy.pool.view(0))


def read_swap(strategy: CycleStartOldLogProb, batch: TrainBatch) -> torch.Tensor:
    """Swap slot 0 into the live tensors around the forward pass; the pool swaps them back, also on error."""
    start = time.perf_counter()
    with strategy.pool.swapped(0):
        forward_start = time.perf_counter()
        logp = strategy.score(strategy.model, batch, None)
        forward_s = time.perf_counter() - forward_start
    strategy.snapshot_s += time.perf_counter() - start - forward_s  # the two swaps
    return logp


SLOT_READERS: dict[str, Callable[[CycleStartOldLogProb, TrainBatch], torch.Tensor]] = {
    "view": read_view,
    "swap": read_swap,
}


def _lookup(registry: dict, name: str, what: str):
    try:
        return registry[name]
    except KeyError:
        raise UnknownStrategyError(f"unknown {what} {name!r}; valid names: {', '.join(registry)}") from None


class CycleStartOldLogProb(OldLogProbStrategy):
    name = "cycle_start"
    anchor = "cycle_start"

    def __init__(self, model, optimizer, score, cfg, reader: str = "auto"):
        super().__init__(model, optimizer, score, cfg)
        from dppo.snapshot import SnapshotPool

        self._pool = SnapshotPool(model, device_budget_bytes=cfg.snapshot.device_budget_bytes)
        # The save at trigger 0 is asynchronous: the first optimizer step must not overwrite a weight
        # before the copy has read it.
        self._guard = self._pool.guard(optimizer)
        self.use_reader(reader)

    @property
    def pool(self):
        return self._pool

    def use_reader(self, name: str) -> None:
        """Read slot 0 at triggers k >= 1 with SLOT_READERS[name] ("auto": chosen at the first read)."""
        self._reader = None if name == "auto" else _lookup(SLOT_READERS, name, "slot reader")
        self.reader_name = name

    def _choose_reader(self) -> Callable[[CycleStartOldLogProb, TrainBatch], torch.Tensor]:
        on_cpu = all(p.device.type == "cpu" for p in self.model.parameters())
        name = "view" if on_cpu or self._pool.tier(0) == "device" else "swap"
        self.reader_name = name
        return SLOT_READERS[name]

    def compute(self, trigger: int, batch: TrainBatch) -> torch.Tensor:
        if trigger == 0:
            start = time.perf_counter()
            self._pool.save(0)  # returns at once; the copy reads the weights while the forward pass below runs
            self.snapshot_s += time.perf_counter() - start
            return self.score(self.model, batch, None)
        if 0 not in self._pool:
            raise RuntimeError(f"trigger {trigger}: snapshot slot 0 is empty; trigger 0 of the cycle must run first")
        if self._reader is None:
            self._reader = self._choose_reader()
        return self._reader(self, batch)

    def close(self) -> None:
        remove = getattr(self._guard, "remove", None)
        if remove is not None:
            remove()
        if 0 in self._pool:
            self._pool.fence()
            self._pool.clear(0)


OLD_LOG_PROB_STRATEGIES: dict[str, type[OldLogProbStrategy]] = {
    "bypass": BypassOldLogProb,
    "current": CurrentOldLogProb,
    "cycle_start": CycleStartOldLogProb,
}


def select_strategy_name(cfg) -> str:
    """The strategy cfg asks for (see the module docstring)."""
    if cfg.algorithm.rollout_correction.bypass_mode:
        return "bypass"
    if cfg.algorithm.prox_anchor == "current" or cfg.trainer.parameter_sync_step == 1:
        return "current"
    return "cycle_start"


# ---------------------------------------------------------------------------------------------------
# Verification (trainer.verify_old_log_prob)
# ---------------------------------------------------------------------------------------------------


class VerifiedOldLogProb(OldLogProbStrategy):
    """Wraps a strategy; scores every batch again with an independent deep copy of the anchor weights.

    max_abs_diff is the largest |old log-prob used - deep copy's| over valid tokens since the last reset.
    """

    def __init__(self, inner: OldLogProbStrategy):
        if inner.anchor is None:
            raise ValueError(f"strategy {inner.name!r} does not recompute old log-probs; there is nothing to verify")
        super().__init__(inner.model, inner.optimizer, inner.score, inner.cfg)
        self.inner = inner
        self.name, self.anchor = inner.name, inner.anchor
        self.reference: torch.nn.Module | None = None
        self.max_abs_diff = 0.0

    @property
    def pool(self):
        return self.inner.pool

    def take_snapshot_s(self) -> float:
        return self.inner.take_snapshot_s()

    def compute(self, trigger: int, batch: TrainBatch) -> torch.Tensor:
        if trigger == 0 or self.anchor == "current":
            self.reference = copy.deepcopy(self.model)  # the anchor weights, independent of the snapshot
        logp = self.inner.compute(trigger, batch)
        expected = self.score(self.reference, batch, None)
        mask = batch.response_mask
        diff = (logp - expected).abs()[mask]
        if diff.numel():
            self.max_abs_diff = max(self.max_abs_diff, float(diff.max()))
        return logp

    def end_cycle(self) -> None:
        self.inner.end_cycle()

    def close(self) -> None:
        self.inner.close()


def make_old_log_prob(model, optimizer, score: ScoreFn, cfg, name: str | None = None) -> OldLogProbStrategy:
    """The strategy named name (default: select_strategy_name(cfg)), verified if trainer.verify_old_log_prob."""
    name = name or select_strategy_name(cfg)
    strategy = _lookup(OLD_LOG_PROB_STRATEGIES, name, "old-log-prob strategy")(model, optimizer, score, cfg)
    if cfg.trainer.verify_old_log_prob:
        strategy = VerifiedOldLogProb(strategy)
    return strategy
