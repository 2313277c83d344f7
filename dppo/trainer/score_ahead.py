"""Score ahead: at trigger 0 of a Decoupled PPO cycle, the later mini-batches that have already arrived are
scored with the live weights, which are pi_old until trigger 0's optimizer step.

    trigger 0:  groups_0 <- rollout.fetch(G, v)                      waits, as every trigger does
                groups_k <- rollout.fetch_ready(G, v), k = 1, 2 ..   no wait; stops at the first not all there
                prox_logp_k <- actor.score_ahead([collate(groups_k) for each k], whole_cycle)
                              one call to the ranks, no grad, the live weights (= pi_old); whole_cycle (every
                              later one taken): the strategy takes no snapshot this cycle (skip_snapshot)
    trigger k:  held: update_actor(..., prox_logp_k), no slot read;  else fetch and read slot 0 as before

The groups are the very ones, in the same order, that triggers 1.. would have fetched: the replay buffer takes in
grant order under `wait` and by the same rules under `drop`, and staleness is measured against the trainer's
version, which does not change within a cycle. In trainer.mode=sync nothing runs ahead, so fetch_ready generates
the cycle's groups at trigger 0 (a ticket is seeded by its grant index: the same samples). The scoring runs the
passes a slot read at trigger k would run (the same shard of the mini-batch on each rank, the same micro-batches),
so the old log-probs are bitwise those of slot 0. The held mini-batches and their old log-probs are part of the
cycle's progress (dppo.trainer.resume.CycleProgress): a mid-cycle checkpoint keeps them, and counts their groups
as taken.
"""

from __future__ import annotations

from dataclasses import dataclass

from dppo.rollout import Group
from dppo.trainer.resume import HeldBatch


@dataclass
class Ahead:
    """What trigger 0's score-ahead took: committed with trigger 0 (BaseTrainer._hold)."""

    held: list[HeldBatch]  # the mini-batches of triggers 1 .. len(held), in order
    dropped: int  # groups the takes dropped as too stale (drop strategy)
    fraction: float  # len(held) / the cycle's later mini-batches: snapshot/scored_ahead_frac
    seconds: float  # the takes and the scoring: timing_s/score_ahead


def take_ready(rollout, count: int, num_groups: int, version: int) -> tuple[list[list[Group]], int]:
    """Up to count mini-batches of num_groups groups that the rollout has ready, in the order the triggers after
    this one would fetch them (stopping at the first that is not all there); and the groups dropped meanwhile."""
    taken, dropped = [], 0
    for _ in range(count):
        got = rollout.fetch_ready(num_groups, version)
        if got is None:
            break
        taken.append(got[0])
        dropped += got[1]
    return taken, dropped
