"""trainer.verify_old_log_prob (PiOldChoice.verify): every old log-prob the loss uses, checked against an independent
copy of pi_old's weights.

ReferenceVerifier scores each trigger's mini-batch again with a copy of pi_old's weights made by copy_model (default
copy.deepcopy; a sharded actor gathers its full weights into a plain module): at trigger 0 of a cycle where pi_old
is the cycle-start weights, at every trigger where pi_old is the live weights. It scores before the update moves the
live weights, and compares in check() with what the loss used (a separate pass's, the training forward's own,
detached, or one scored ahead). end_cycle() reports debug/old_log_prob_max_abs_diff: the largest difference over
the valid tokens of the cycle. A cycle resumed mid-way gets its copy from the checkpoint (the ranks' anchor, or
the weights it was published as: load_published); one from a checkpoint of an older dppo that kept neither has
none to check its scored-ahead old log-probs against: debug/old_log_prob_unverified counts those.

NoVerifier, for runs that do not verify, does nothing.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from dppo.batch import TrainBatch
from dppo.workers.actor.pi_old_sources import with_weights
from dppo.workers.actor.slot_readers import ScoreFn

# copy_model(model) -> a module holding model's current weights, independent of them
CopyModel = Callable[[torch.nn.Module], torch.nn.Module]


class OldLogProbVerifier(ABC):
    """What the provider (dppo.workers.actor.pi_old) tells the verifier of each trigger's old log-probs."""

    @abstractmethod
    def expect(self, trigger: int, batch: TrainBatch) -> None:
        """The source is about to compute the trigger's old log-probs of batch (the live weights still those of
        the trigger's start)."""

    @abstractmethod
    def expect_scored(self, batch: TrainBatch) -> None:
        """batch's old log-probs were scored ahead at trigger 0 (no source computes them)."""

    @abstractmethod
    def check(self, batch: TrainBatch, prox_logp: torch.Tensor) -> None:
        """After the update: the old log-probs (B, R) its loss used."""

    def load_anchor(self, weights: dict[str, torch.Tensor]) -> None:
        """A resumed cycle's pi_old weights, as the ranks kept them (a sharded model's local shards)."""

    def load_published(self, weights: dict[str, torch.Tensor], build: Callable[[dict], torch.nn.Module]) -> None:
        """A resumed cycle's whole pi_old weights as published (the ranks kept none); build makes a plain module."""

    def state(self) -> dict[str, float]:
        """The cycle's verification so far (plain numbers), for a mid-cycle checkpoint."""
        return {}

    def load_state(self, state: dict) -> None:
        """Continue from state() of a checkpointed run ({}: nothing kept)."""

    def end_cycle(self) -> dict[str, float]:
        """The cycle's debug/old_log_prob_* metrics; starts the next cycle's."""
        return {}


class NoVerifier(OldLogProbVerifier):
    def expect(self, trigger: int, batch: TrainBatch) -> None:
        pass

    def expect_scored(self, batch: TrainBatch) -> None:
        pass

    def check(self, batch: TrainBatch, prox_logp: torch.Tensor) -> None:
        pass


class ReferenceVerifier(OldLogProbVerifier):
    """See the module docstring. follows_live: pi_old is the live weights at every trigger (PiOldChoice.source live),
    so the copy is made anew at every trigger and a checkpoint's anchor is never pi_old."""

    def __init__(
        self, model: torch.nn.Module, score: ScoreFn, follows_live: bool, copy_model: CopyModel = copy.deepcopy
    ) -> None:
        self.model, self.score, self.follows_live, self.copy_model = model, score, follows_live, copy_model
        self.reference: torch.nn.Module | None = None
        self._expected: torch.Tensor | None = None  # (B, R) the reference's log-probs of the trigger's batch
        self.max_abs_diff = 0.0
        self.unverified = 0  # scored-ahead mini-batches of the cycle that had no reference to check against
        self._unverifiable = False  # the trigger's old log-probs were scored ahead and there is no reference

    def expect(self, trigger: int, batch: TrainBatch) -> None:
        if trigger == 0 or self.follows_live:
            self.reference = self.copy_model(self.model)  # the anchor weights, independent of the snapshot
        self._expected = self.score(self.reference, batch, None)

    def expect_scored(self, batch: TrainBatch) -> None:
        # none to compare with in a cycle resumed mid-way that kept no pi_old weights (all of it scored ahead)
        self._expected = None if self.reference is None else self.score(self.reference, batch, None)
        self._unverifiable = self.reference is None

    def check(self, batch: TrainBatch, prox_logp: torch.Tensor) -> None:
        expected, self._expected = self._expected, None
        if expected is None and self._unverifiable:
            self.unverified, self._unverifiable = self.unverified + 1, False
            return
        if expected is None:
            raise RuntimeError("record_used without a compute before it: there is nothing to compare with")
        diff = (prox_logp - expected).abs()[batch.response_mask]
        if diff.numel():
            self.max_abs_diff = max(self.max_abs_diff, float(diff.max()))

    def load_anchor(self, weights: dict[str, torch.Tensor]) -> None:
        if not self.follows_live:
            self.reference = with_weights(self.model, weights, lambda: self.copy_model(self.model))

    def load_published(self, weights: dict[str, torch.Tensor], build: Callable[[dict], torch.nn.Module]) -> None:
        """The reference the rest of a resumed cycle (its mini-batches scored ahead) is checked against."""
        if not self.follows_live:
            self.reference = build(weights)

    def state(self) -> dict[str, float]:
        """A cycle resumed mid-way reports its whole cycle's largest difference."""
        return {"max_abs_diff": self.max_abs_diff, "unverified": self.unverified}

    def load_state(self, state: dict) -> None:
        self.max_abs_diff = float(state.get("max_abs_diff", 0.0))
        self.unverified = int(state.get("unverified", 0))

    def end_cycle(self) -> dict[str, float]:
        diff, self.max_abs_diff = self.max_abs_diff, 0.0
        metrics = {"debug/old_log_prob_max_abs_diff": diff}
        if self.unverified:
            metrics["debug/old_log_prob_unverified"] = float(self.unverified)
            self.unverified = 0
        return metrics
