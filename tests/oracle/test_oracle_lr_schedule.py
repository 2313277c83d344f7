"""actor.optim's lr schedule is verl 0.9.1's: dppo's factor of every optimizer step equals the lambda of verl's own
get_constant_schedule_with_warmup and get_cosine_schedule_with_warmup built as verl's FSDP engine builds them
(_build_lr_scheduler: lr_warmup_steps, else int(lr_warmup_steps_ratio x total))."""

from __future__ import annotations

import pytest
import torch

from dppo.config.schema import ActorOptimSection
from dppo.workers.actor.lr_schedule import lr_factor

pytestmark = pytest.mark.oracle

TOTAL = 37


def verl_lambda(optim: ActorOptimSection, total: int):
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
def test_every_steps_factor_is_verls(settings):
    optim = ActorOptimSection(**settings)
    ours, verls = lr_factor(optim, TOTAL), verl_lambda(optim, TOTAL)
    factors = [ours(step) for step in range(TOTAL + 3)]  # a few past the end too
    assert factors == [verls(step) for step in range(TOTAL + 3)]
    assert len(set(factors)) > 1 or settings == {}  # each case is a curve, not a constant
