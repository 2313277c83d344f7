"""The pi_old provider (dppo.workers.actor.pi_old): one per rank, composed of one piece per field of the choice; per
trigger it asks its source only where the method needs the exact pi_old, and takes old log-probs scored ahead as
they are."""

import pytest
import torch

from dppo.batch import TrainBatch
from dppo.config.pi_old import PiOldChoice
from dppo.workers.actor.pi_old import PiOldProvider, make_pi_old
from dppo.workers.actor.pi_old_sources import (
    BehavSource,
    ReferenceSource,
    LiveSource,
    NoSource,
    PiOldSource,
    SlotSource,
)
from dppo.workers.actor.pi_old_verify import NoVerifier, ReferenceVerifier
from dppo.workers.actor.prox_auto import AutoProxSwitch
from dppo.workers.actor.prox_method import Auto, Loglinear, Metrics, Recompute

SLOT = PiOldChoice(source="slot", reader="auto", parameter_sync_step=4)


@pytest.mark.parametrize("choice, source_cls, method_cls, verifier_cls", [
    (SLOT, SlotSource, Recompute, NoVerifier),
    (PiOldChoice(source="slot", reader="swap", method="metrics", verify=True), SlotSource, Metrics, ReferenceVerifier),
    (PiOldChoice(source="slot", reader="auto", method="auto"), SlotSource, Auto, NoVerifier),
    (PiOldChoice(source="live", verify=True), LiveSource, Recompute, ReferenceVerifier),
    (PiOldChoice(source="behav"), BehavSource, Recompute, NoVerifier),
    (PiOldChoice(source="reference", verify=True), ReferenceSource, Recompute, ReferenceVerifier),
    (PiOldChoice(source="none", method="loglinear"), NoSource, Loglinear, NoVerifier),
])  # fmt: skip
def test_make_pi_old_composes_one_piece_per_field_of_the_plan(choice, source_cls, method_cls, verifier_cls):
    model = torch.nn.Linear(3, 2)
    pi_old = make_pi_old(choice, model, torch.optim.AdamW(model.parameters()), score=None)
    assert (type(pi_old.source), type(pi_old.method), type(pi_old.verifier)) == (source_cls, method_cls, verifier_cls)
    assert pi_old.choice is choice and (pi_old.source.pool is not None) == (choice.source == "slot")
    if choice.source == "slot":
        assert pi_old.source.reader_name == choice.reader
    if verifier_cls is ReferenceVerifier:  # pi_old is the live weights at every trigger: a new copy each time
        assert pi_old.verifier.follows_live == (choice.source == "live")
    pi_old.close()


def test_auto_gets_its_switch_from_the_plan():
    choice = PiOldChoice(
        source="slot", reader="auto", method="auto", check_every=3, max_is_err=0.5, stale_samples=False
    )
    model = torch.nn.Linear(3, 2)
    switch = make_pi_old(choice, model, torch.optim.AdamW(model.parameters()), score=None).method.switch
    assert (switch.check_every, switch.max_is_err, switch.stale_samples) == (3, 0.5, False)


class SpySource(PiOldSource):
    """Records what the provider asks of it; its old log-probs are the behavior log-probs plus one."""

    name = "spy"

    def __init__(self, choice: PiOldChoice) -> None:
        super().__init__(None, None, None, choice)
        self.calls: list = []

    def compute(self, trigger: int, batch: TrainBatch) -> torch.Tensor:
        self.calls.append(("compute", trigger))
        return batch.behav_logp + 1

    def skip_snapshot(self) -> None:
        self.calls.append("skip_snapshot")

    def skip_cycle(self) -> None:
        self.calls.append("skip_cycle")


def make_batch() -> TrainBatch:
    gen = torch.Generator().manual_seed(0)
    return TrainBatch(
        torch.randint(0, 5, (4, 6), generator=gen),
        torch.ones(4, 3, dtype=torch.bool),
        -torch.rand(4, 3, generator=gen),
        torch.zeros(4),
        torch.arange(4) // 2,
        torch.zeros(2, dtype=torch.long),
    )


def test_auto_between_its_checks_asks_the_source_for_nothing_and_on_a_check_cycle_for_every_trigger():
    choice = PiOldChoice(source="slot", reader="auto", method="auto", check_every=2, parameter_sync_step=2)
    switch = AutoProxSwitch(check_every=2, max_is_err=0.01)
    switch.load_state({"approx_ok": True, "cycles_since_check": 1, "cycle_errs": [], "cycle_interp": 0.0})
    source, batch = SpySource(choice), make_batch()
    pi_old = PiOldProvider(choice, None, source, Auto(switch), NoVerifier())
    loglinear = [pi_old.prox(k, batch, 3) for k in range(2)]  # the switch's check passed a cycle ago
    assert source.calls == ["skip_cycle"]  # trigger 0 takes no snapshot, and slot 0's older pi_old is not this one's
    assert all(callable(prox.value) for prox in loglinear)  # a ProxFn of the training forward: approximated
    source.calls.clear()
    exact = [pi_old.prox(k, batch, 4) for k in range(2)]  # the next cycle is a check (every 2nd)
    assert source.calls == [("compute", 0), ("compute", 1)]
    assert all(torch.equal(prox.value, batch.behav_logp + 1) for prox in exact)
    assert [prox.steps.v_theta for prox in exact] == [8, 9]  # version 4 x 2 steps a cycle, + the trigger


def test_old_log_probs_scored_ahead_are_used_as_they_are_and_read_nothing():
    source, batch = SpySource(SLOT), make_batch()
    pi_old = PiOldProvider(SLOT, None, source, Recompute(), NoVerifier())
    pi_old.skip_snapshot()
    scored = torch.full((4, 3), -0.5)
    prox = pi_old.prox(1, batch, 0, scored)
    assert prox.value is scored and source.calls == ["skip_snapshot"]
