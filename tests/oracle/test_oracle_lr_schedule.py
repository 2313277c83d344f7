"""actor.optim's lr schedule is verl 0.9.1's, in verl's unit: the lambda of verl's own get_constant_schedule_with_warmup
and get_cosine_schedule_with_warmup built as verl's FSDP engine builds them (_build_lr_scheduler: lr_warmup_steps, else
int(lr_warmup_steps_ratio x total)) over the run's global steps (verl's scheduler steps once per update call, after the
last of the update's optimizer steps: engine_workers' update_lr_scheduler). dppo's factor at trigger 0 of global step
k is verl's lambda(k), bitwise; at trigger j it is verl's curve at k + j / parameter_sync_step."""

from __future__ import annotations

import pytest
import torch

from dppo.config.schema import ActorOptimSection
from dppo.workers.actor.lr_schedule import lr_factor

pytestmark = pytest.mark.oracle

TOTAL = 37  # global steps


def verl_lambda(optim: ActorOptimSection, total: int):
    """verl's lr lambda of optim over total global steps (its step: a global step)."""
    from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

    warmup = optim.lr_warmup_steps
    if warmup <= 0:  # verl's engine: the ratio decides
        warmup = int(optim.lr_warmup_steps_ratio * total)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    if optim.lr_scheduler_type == "constant":
        scheduler = get_constant_schedule_with_warmup(optimizer, num_warmup_steps=warmup)
    else:
        scheduler = get_cosine_schedule_with_warmup(
            optimizer,
            num_warmup_steps=warmup,
            num_training_steps=total,
            min_lr_ratio=optim.min_lr_ratio,
            num_cycles=optim.num_cycles,
            zero_indexed_step=optim.zero_indexed_step,
        )
    return scheduler.lr_lambdas[0]


@pytest.mark.parametrize("settings", [
    {},                                                                   # constant, no warmup: 1 throughout
    {"lr_warmup_steps": 5},
    {"lr_warmup_steps_ratio": 0.1},                                       # int(3.7) = 3 steps
    {"lr_scheduler_type": "cosine"},
    {"lr_scheduler_type": "cosine", "lr_warmup_steps_ratio": 0.1, "min_lr_ratio": 0.1},
    {"lr_scheduler_type": "cosine", "lr_warmup_steps": 4, "num_cycles": 1.5, "min_lr_ratio": 0.2},
    {"lr_scheduler_type": "cosine", "lr_warmup_steps": 4, "zero_indexed_step": False},
    {"warmup_style": "cosine", "lr_warmup_steps": 2, "lr_warmup_steps_ratio": 0.5},  # steps win over the ratio
])  # fmt: skip
@pytest.mark.parametrize("per_global", [1, 3])  # trainer.parameter_sync_step: optimizer steps per global step
def test_every_steps_factor_is_verls(settings, per_global):
    optim = ActorOptimSection(**settings)
    ours, verls = lr_factor(optim, TOTAL, per_global), verl_lambda(optim, TOTAL)
    steps = range((TOTAL + 3) * per_global)  # a few global steps past the end too
    factors = [ours(step) for step in steps]
    # trigger 0 of every global step k: verl's lambda(k), bitwise
    assert factors[::per_global] == [verls(k) for k in range(TOTAL + 3)]
    # every trigger j: verl's curve at k + j / per_global (computed there in floats: one rounding apart)
    assert factors == pytest.approx([verls(step / per_global) for step in steps], rel=1e-12, abs=1e-15)
    assert len(set(factors)) > 1 or settings == {}  # each case is a curve, not a constant
