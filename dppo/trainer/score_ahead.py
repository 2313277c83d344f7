"""Score ahead: at trigger 0 of a Decoupled PPO cycle, the later mini-batches that have already arrived are
scored with the live weights, which are pi_old until trigger 0's optimizer step (where the run's PiOldChoice says
so: choice.score_ahead, dppo.config.pi_old).

    trigger 0:  groups_0 <- rollout.fetch(G, v)                      waits, as every trigger does
                groups_k <- rollout.fetch_ready(G, v), k = 1, 2 ..   no wait; stops at the first not all there
                prox_logp_k <- actor.score_ahead([collate(groups_k) for each k], whole_cycle)
                              one call to the ranks, no grad, the live weights (= pi_old); whole_cycle (every
                              later one taken): the ranks' pi_old takes no snapshot this cycle (skip_snapshot)
    trigger k:  held: update_actor(..., prox_logp_k), no slot read;  else fetch and read slot 0 as before

The groups are the very ones, in the same order, that triggers 1.. would have fetched: the replay buffer takes in
grant order under `wait` and by the same rules under `drop`, and staleness is measured against the trainer's
version, which does not change within a cycle. In trainer.mode=sync nothing runs ahead, so fetch_ready generates
the cycle's groups at trigger 0 (a ticket is seeded by its grant index: the same samples). The scoring runs the
passes a slot read at trigger k would run (the same shard of the mini-batch on each rank, the same micro-batches),
so the old log-probs are bitwise those of slot 0. The held mini-batches and their old log-probs are part of the
cycle's progress (dppo.trainer.state.CycleProgress): a mid-cycle checkpoint keeps them, and counts their groups
as taken. With algorithm.filter_groups each mini-batch is drawn as its trigger would draw it (dppo.trainer.
filter_groups) from the groups that have arrived; a draw that cannot be filled from them stays pending in the
cycle's progress, and its trigger draws the rest (waiting, and reading slot 0).

Where score-ahead lives: the driver's part here (take_ahead at trigger 0, before it trains; Ahead.hold once trigger 0
is committed: BaseTrainer.run_cycle calls both), the ranks' in ActorRank.score_ahead and the pi_old provider
(dppo.workers.actor.pi_old: skip_snapshot, and the scored old log-probs handed to prox), the held mini-batches in
the cycle's progress (dppo.trainer.state.HeldBatch), the decision in the choice (dppo.config.pi_old).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dppo.batch import Group, TrainBatch, collate
from dppo.trainer.state import CycleProgress, Draw, HeldBatch
from dppo.config.pi_old import PiOldChoice
from dppo.trainer.filter_groups import GroupFilter

# score(batches, whole_cycle) -> log pi_old (B, R) of each batch: the actor group's ActorRank.score_ahead
ScoreAheadFn = Callable[[list[TrainBatch], bool], list[torch.Tensor]]


@dataclass
class Ahead:
    """What trigger 0's score-ahead took: committed with trigger 0 (hold)."""

    held: list[HeldBatch]  # the mini-batches of triggers 1 .. len(held), in order
    draws: list[Draw]  # how each was drawn (the groups taken for it, algorithm.filter_groups)
    pending: Draw | None  # the next trigger's draw, begun but not all there (filter_groups only), or None
    dropped: int  # groups the takes dropped as too stale (drop strategy)
    fraction: float  # len(held) / the cycle's later mini-batches: snapshot/scored_ahead_frac
    seconds: float  # the takes and the scoring: timing_s/score_ahead

    def hold(
        self,
        progress: CycleProgress,
        commit_draw: Callable[[Draw], None],
        took: Callable[[list[Group], int, int], None],
    ) -> None:
        """Commit trigger 0's score-ahead: the held mini-batches wait in the cycle's progress for their triggers, and a
        draw it began and could not fill waits for its trigger to draw the rest. commit_draw(draw) commits a done draw
        (its groups taken, its filter_groups/* metrics); took(groups, dropped, discarded) the groups the begun one took
        (where the rollout would pick up after them)."""
        progress.ahead = self.held
        progress.pending = self.pending
        progress.metrics.add({"snapshot/scored_ahead_frac": self.fraction, "timing_s/score_ahead": self.seconds})
        for draw in self.draws:
            commit_draw(draw)
        if self.pending is not None:
            progress.dropped += self.pending.dropped
            took(self.pending.taken, self.pending.dropped, self.pending.discarded)


def take_ahead(
    choice: PiOldChoice, rollout, group_filter: GroupFilter, version: int, pad_token: int, score: ScoreAheadFn
) -> Ahead | None:
    """At trigger 0: the cycle's later mini-batches that have already arrived, taken in the order their triggers
    would take them and scored with the live weights, which are pi_old (score: the actor group's score_ahead, one
    call for all of them); None where the choice does not score ahead (choice.score_ahead)."""
    if not choice.score_ahead:
        return None
    later = choice.parameter_sync_step - 1
    start = time.perf_counter()
    draws, pending = take_ready(rollout, later, group_filter, version)
    size = group_filter.size
    batches = [collate(draw.groups(size), pad_token) for draw in draws]
    # whole_cycle (every later one taken): the ranks take no snapshot this cycle
    prox_logps = score(batches, len(draws) == later) if batches else []
    held = [
        HeldBatch(draw.groups(size), logp, draw.taken_scores() if group_filter.enabled else None)
        for draw, logp in zip(draws, prox_logps, strict=True)
    ]
    dropped = sum(d.dropped for d in draws) + (pending.dropped if pending else 0)
    return Ahead(held, draws, pending, dropped, len(held) / later, time.perf_counter() - start)


def take_ready(rollout, count: int, group_filter: GroupFilter, version: int) -> tuple[list[Draw], Draw | None]:
    """Up to count mini-batches' draws from the groups the rollout has ready, in the order the triggers after this one
    would draw them, stopping at the first that is not all there; and that one if it took some groups already (with
    algorithm.filter_groups a draw takes several times, and the groups of its first takes are taken), else None."""
    draws = []
    for _ in range(count):
        draw = group_filter.fetch_ready(rollout, version)
        if not group_filter.done(draw):
            return draws, draw if draw.taken else None
        draws.append(draw)
    return draws, None
