"""The pi_old provider: everything about pi_old on one actor rank, built once from the run's PiOldChoice.

    pi_old = make_pi_old(choice, model, optimizer, score, copy_model)     # choice: the run's, as the rank was handed it

The rank holds this one object and asks it for everything pi_old; it composes three pieces, each chosen by one
field of the choice and each implementing a declared interface:

    source    PiOldSource (dppo.workers.actor.pi_old_sources), choice.source: which weights' log-probs are pi_old and
              how they are scored (the behavior log-probs, the live weights, slot 0, verl v1's reference scheme, none)
    method    ProxMethod (dppo.workers.actor.prox_method), choice.method: how the loss gets log pi_prox from the
              source's (exact, exact and measured, loglinear, auto: its switch is made with it)
    verifier  OldLogProbVerifier (dppo.workers.actor.pi_old_verify), choice.verify: checks what the loss used

Per trigger the update calls, in this order:

    prox = pi_old.prox(trigger, batch, version, scored)   the trigger begins; log pi_old from the source (or
                                                          scored ahead, or nothing: the method approximates);
                                                          the prox the loss uses (a tensor, or a ProxFn)
    ... the update ...
    pi_old.record_step(applied)                           whether the update took its optimizer step
    pi_old.record_used(batch, prox_logp)                  what the loss used (the verifier checks it)
    pi_old.metrics(logp, prox_logp, batch, prox.steps)    the method's metrics of the step (this rank's)
    pi_old.take_snapshot_s()                              timing_s/snapshot
    pi_old.record(merged)                                 the method's metrics from the merged ones (auto's switch)

and per cycle end_cycle() (the verifier's metrics). Score-ahead: skip_snapshot() (every later mini-batch was scored
ahead: trigger 0 takes no snapshot), prox(..., scored=...) for the mini-batches scored ahead. Checkpoints:
anchor_weights / load_anchor / load_published and state / load_state. pool: the SnapshotPool for verl's snapshot
calls (the source's, or one of the provider's own). close() releases the snapshot memory.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dppo import snapshot
from dppo.batch import TrainBatch
from dppo.config.pi_old import PiOldChoice
from dppo.workers.actor.pi_old_sources import PI_OLD_SOURCES, PiOldSource
from dppo.workers.actor.pi_old_verify import CopyModel, NoVerifier, OldLogProbVerifier, ReferenceVerifier
from dppo.workers.actor.prox_method import ProxFn, ProxMethod, StepVersions, make_prox_method
from dppo.workers.actor.slot_readers import ScoreFn

# The keys of PiOldProvider.state(), as a mid-cycle checkpoint's pi_old record has held them since issue 31: the
# method's state across cycles, and the verifier's within the cycle ("strategy": the name of its owner then); since
# issue 42 also the cycle's skipped updates (a checkpoint without it: none).
METHOD_STATE, VERIFIER_STATE, SKIPPED_STATE = "method", "strategy", "skipped"


@dataclass(frozen=True)
class TriggerProx:
    """What the loss of one trigger takes from pi_old."""

    value: torch.Tensor | ProxFn  # log pi_prox (b, R), or a ProxFn of each micro-batch's training forward
    steps: StepVersions  # the optimizer-step counts of the trigger's policies
    old_log_prob_s: float  # seconds spent computing the old log-probs (timing_s/old_log_prob)


class PiOldProvider:
    """pi_old on one rank (see the module docstring)."""

    def __init__(
        self,
        choice: PiOldChoice,
        model: torch.nn.Module,
        source: PiOldSource,
        method: ProxMethod,
        verifier: OldLogProbVerifier,
    ) -> None:
        self.choice, self.model = choice, model
        self.source, self.method, self.verifier = source, method, verifier
        self._own_pool: snapshot.SnapshotPool | None = None  # for verl's snapshot calls where the source keeps none
        self._skipped = 0  # the current cycle's triggers whose update was not applied (StepVersions.v_theta)

    # ---- a trigger ---------------------------------------------------------------------------------

    def prox(self, trigger: int, batch: TrainBatch, version: int, scored: torch.Tensor | None = None) -> TriggerProx:
        """Begin the trigger and give the prox its loss uses. version: the trainer's policy version at the cycle
        start; scored: batch's old log-probs (b, R) scored ahead at trigger 0 (on batch's device), or None."""
        self.method.begin_trigger(trigger)
        if trigger == 0:
            self._skipped = 0
        start = time.perf_counter()
        old_logp = self._old_log_probs(trigger, batch, scored)  # (b, R), or None: from the training forward
        old_log_prob_s = time.perf_counter() - start
        steps = StepVersions.of(batch, version, trigger, self.choice.parameter_sync_step, self._skipped)
        return TriggerProx(self.method.prox(old_logp, batch, steps), steps, old_log_prob_s)

    def _old_log_probs(self, trigger: int, batch: TrainBatch, scored: torch.Tensor | None) -> torch.Tensor | None:
        if scored is not None:  # scored ahead at trigger 0 with the live weights, which were pi_old: no slot read
            self.verifier.expect_scored(batch)
            return scored
        if not self.method.exact_this_cycle():  # loglinear approximates: no snapshot, no pass
            if trigger == 0:
                self.source.skip_cycle()
            return None
        self.verifier.expect(trigger, batch)
        return self.source.compute(trigger, batch)

    def record_step(self, applied: bool) -> None:
        """After the update: whether it took its optimizer step (False: actor.max_ppo_kl or a non-finite gradient
        skipped it, and the weights did not move); the cycle's later triggers count only the applied ones."""
        if not applied:
            self._skipped += 1

    def record_used(self, batch: TrainBatch, prox_logp: torch.Tensor) -> None:
        """After the update: the old log-probs (b, R) its loss used."""
        self.verifier.check(batch, prox_logp)

    def metrics(
        self, logp: torch.Tensor, prox_logp: torch.Tensor, batch: TrainBatch, steps: StepVersions
    ) -> dict[str, float]:
        """This rank's metrics of the step from the training forward's log-probs logp (b, R) and the prox used."""
        return self.method.metrics(logp, prox_logp, batch, steps)

    def take_snapshot_s(self) -> float:
        """Seconds spent in snapshot calls since the last call (timing_s/snapshot)."""
        return self.source.take_snapshot_s()

    def record(self, merged: dict[str, float]) -> dict[str, float]:
        """The trigger's metrics merged over the ranks; returns the method's metrics to add."""
        return self.method.record(merged)

    def end_cycle(self) -> dict[str, float]:
        """Called once the cycle's last trigger is done; this rank's metrics of the cycle."""
        return self.verifier.end_cycle()

    # ---- score-ahead -------------------------------------------------------------------------------

    def skip_snapshot(self) -> None:
        """Every later mini-batch of the cycle about to start was scored ahead: its trigger 0 takes no snapshot."""
        self.source.skip_snapshot()

    # ---- checkpoints -------------------------------------------------------------------------------

    def anchor_weights(self) -> dict[str, torch.Tensor] | None:
        """pi_old's weights as CPU tensors where the ranks keep them apart from the live ones mid-cycle; else None."""
        return self.source.anchor_weights()

    def load_anchor(self, weights: dict[str, torch.Tensor]) -> None:
        """Make weights (from anchor_weights()) pi_old for the rest of the current cycle."""
        self.source.load_anchor(weights)
        self.verifier.load_anchor(weights)

    def load_published(self, weights: dict[str, torch.Tensor], build: Callable[[dict], torch.nn.Module]) -> None:
        """pi_old's whole weights as published (a mid-cycle checkpoint that kept none on the ranks); build(state)
        makes a plain module holding them. Only the verifier needs them."""
        self.verifier.load_published(weights, build)

    def state(self) -> dict:
        """What a checkpoint keeps of pi_old besides its weights: the method's state across cycles (auto's switch),
        the verifier's and the count of skipped updates within the cycle."""
        return {METHOD_STATE: self.method.state(), VERIFIER_STATE: self.verifier.state(), SKIPPED_STATE: self._skipped}

    def load_state(self, state: dict) -> None:
        """Continue from state() of a checkpointed run (a missing part: nothing kept)."""
        self.method.load_state(state.get(METHOD_STATE) or {})
        self.verifier.load_state(state.get(VERIFIER_STATE) or {})
        self._skipped = int(state.get(SKIPPED_STATE, 0))

    # ---- the rest ----------------------------------------------------------------------------------

    @property
    def pool(self) -> snapshot.SnapshotPool:
        """The SnapshotPool for verl's snapshot calls: the source's, or one of the provider's own."""
        if self.source.pool is not None:
            return self.source.pool
        if self._own_pool is None:
            self._own_pool = snapshot.SnapshotPool(
                self.model, device_budget_bytes=self.choice.device_budget_bytes, trainable_only=True
            )
        return self._own_pool

    def close(self) -> None:
        """Release the source's snapshot memory (the pool of verl's snapshot calls is theirs to clear)."""
        self.source.close()


def make_pi_old(
    choice: PiOldChoice,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    score: ScoreFn,
    copy_model: CopyModel = copy.deepcopy,
) -> PiOldProvider:
    """The provider of choice over the rank's model and optimizer; score(module, batch, params) scores in the rank's
    precision; copy_model makes the verifier's independent copies of pi_old (choice.verify)."""
    source = PI_OLD_SOURCES[choice.source](model, optimizer, score, choice)
    verifier = ReferenceVerifier(model, score, choice.source == "live", copy_model) if choice.verify else NoVerifier()
    return PiOldProvider(choice, model, source, make_prox_method(choice), verifier)
