"""Score ahead: at trigger 0 of a Decoupled PPO cycle, the later mini-batches that have already arrived are
scored with the live weights, which are pi_old until trigger 0's optimizer step.

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
cycle's progress (dppo.checkpoint.state.CycleProgress): a mid-cycle checkpoint keeps them, and counts their groups
as taken. With algorithm.filter_groups each mini-batch is drawn as its trigger would draw it (dppo.trainer.
filter_groups) from the groups that have arrived; a draw that cannot be filled from them stays pending in the
cycle's progress, and its trigger draws the rest (waiting, and reading slot 0).
"""

from __future__ import annotations

from dataclasses import dataclass

from dppo.trainer.filter_groups import GroupFilter
from dppo.checkpoint.state import Draw, HeldBatch


@dataclass
class Ahead:
    """What trigger 0's score-ahead took: committed with trigger 0 (BaseTrainer._hold)."""

    held: list[HeldBatch]  # the mini-batches of triggers 1 .. len(held), in order
    draws: list[Draw]  # how each was drawn (the groups taken for it, algorithm.filter_groups)
    pending: Draw | None  # the next trigger's draw, begun but not all there (filter_groups only), or None
    dropped: int  # groups the takes dropped as too stale (drop strategy)
    fraction: float  # len(held) / the cycle's later mini-batches: snapshot/scored_ahead_frac
    seconds: float  # the takes and the scoring: timing_s/score_ahead


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
