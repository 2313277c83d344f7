"""The actor's learning-rate schedule (actor.optim): verl's two schedules, in verl's unit, the global step.

    factor(step)   the lr of optimizer step `step` (0-based) is actor.lr x factor(step)
    constant       x / warmup during the warmup, then 1                   (verl's get_constant_schedule_with_warmup)
    cosine         x / warmup during the warmup, then a cosine from 1 down to min_lr_ratio, reached at the end of the
                   run's last global step with num_cycles=0.5             (verl's get_cosine_schedule_with_warmup)

x is the optimizer step's place in global steps: trigger j of global step k (step = k p + j, p =
trainer.parameter_sync_step) is at x = k + j / p. verl's step is a global step: its scheduler steps once per update
call, after the update's last optimizer step, over verl's trainer.total_training_steps; lr_warmup_steps is counted in
them. So at every cycle's trigger 0 dppo's factor is verl's of that global step, bitwise
(tests/oracle/test_oracle_lr_schedule.py); between, where verl holds that lr through the step's optimizer steps, dppo
goes on along the same curve. The arithmetic is in optimizer steps (integers: k p + j against the warmup's and the
run's global steps times p), so at j = 0 the quotients are verl's exactly.

The schedule is a torch LambdaLR over the rank's optimizer, stepped once per trigger whether or not the trigger's
update was applied (actor.max_ppo_kl, a non-finite gradient), as verl steps its scheduler after every update call.
Its one piece of state is the number of steps taken (last_epoch), which every rank writes into its checkpoint
(dppo.workers.actor.sharded_state) and reads back, so a resumed run follows the same curve.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
from torch.optim.lr_scheduler import LambdaLR


def lr_factor(optim_cfg, total_steps: int, parameter_sync_step: int) -> Callable[[int], float]:
    """factor(step) of actor.optim's schedule in a run of total_steps global steps (trainer.total_steps) of
    parameter_sync_step optimizer steps each: verl's formulas, term by term, in optimizer steps (tests/oracle compares
    them with verl's own functions)."""
    per_global = parameter_sync_step
    total = total_steps * per_global  # optimizer steps
    warmup = optim_cfg.warmup_steps(total_steps, per_global)  # optimizer steps: whole global steps
    if optim_cfg.lr_scheduler_type == "constant":

        def constant(step: int) -> float:
            if step < warmup:
                return float(step) / float(max(1.0, warmup))
            return 1.0

        return constant

    floor, cycles, zero_indexed = optim_cfg.min_lr_ratio, optim_cfg.num_cycles, optim_cfg.zero_indexed_step
    coef, intercept = (1 - floor) * 0.5, (1 + floor) * 0.5

    def cosine(step: int) -> float:
        if not zero_indexed:
            step += per_global  # verl's step + 1: one global step
        if step < warmup:
            return float(step) / float(max(1, warmup))
        progress = float(step - warmup) / float(max(1, total - warmup))
        return max(floor, math.cos(math.pi * float(cycles) * 2.0 * progress) * coef + intercept)

    return cosine


def make_lr_scheduler(
    optimizer: torch.optim.Optimizer, optim_cfg, total_steps: int, parameter_sync_step: int
) -> LambdaLR:
    """The schedule of optim_cfg (actor.optim) over optimizer (its lr is actor.lr), for the run's total_steps global
    steps of parameter_sync_step optimizer steps; the optimizer's lr is set to step 0's."""
    return LambdaLR(optimizer, lr_factor(optim_cfg, total_steps, parameter_sync_step))


def step_lr(scheduler: LambdaLR) -> None:
    """Advance the schedule by one optimizer step. torch warns when the scheduler steps before the optimizer ever
    has; a first update skipped on purpose (actor.max_ppo_kl, a non-finite gradient) is not that mistake."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
        scheduler.step()


def set_lr_step(scheduler: LambdaLR, step: int) -> None:
    """Put the schedule at `step` optimizer steps taken (a resumed run): the optimizer's lr becomes that step's,
    computed as the uninterrupted run's scheduler.step() computed it."""
    scheduler.last_epoch = step - 1
    step_lr(scheduler)
