"""The loop's state: where the run is (TrainerState: its steps and version, how far the current sync cycle got,
where the rollout picks up), moved by the step loop (dppo.trainer.base), score-ahead, the group filter and the
rollout sources. Each class turns itself into the tensors and plain types a checkpoint's trainer.pt holds
(to_state; torch.load(weights_only=True) reads them) and back (from_state); dppo.checkpoint.run stores that layout
and never sees the classes. The RNG states are dppo.rng's.

A run resumed from a checkpoint continues exactly where the checkpointed one was: a boundary checkpoint
(trigger 0) at the start of the next sync cycle, a mid-cycle one (written when the rollout failed beyond
recovery) at the trigger it was on, with that cycle's accumulated metrics, its pi_old weights (where a later
trigger still reads slot 0) and the mini-batches taken and scored ahead for its later triggers, with their old
log-probs (dppo.trainer.score_ahead).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch

from dppo.batch import AGENT_COUNTS, Group

# ---- the current sync cycle -----------------------------------------------------------------------------


# Trigger metrics that count events: summed over a cycle's triggers, like the times (actor.max_ppo_kl's skips,
# algorithm.filter_groups' triggers at its limit)
COUNTED_METRICS = ("actor/skipped_updates", "filter_groups/at_limit", "schedule/bytes", *AGENT_COUNTS)


@dataclass
class CycleMetrics:
    """Accumulates trigger metrics into one record: timing_s/* and COUNTED_METRICS summed, *_max / *_min extremes,
    the rest averaged."""

    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    extremes: dict[str, float] = field(default_factory=dict)

    def add(self, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if key.startswith("timing_s/") or key in COUNTED_METRICS:
                self.sums[key] = self.sums.get(key, 0.0) + value
                self.counts[key] = 1
            elif key.endswith("_max"):
                self.extremes[key] = max(self.extremes.get(key, -math.inf), value)
            elif key.endswith("_min"):
                self.extremes[key] = min(self.extremes.get(key, math.inf), value)
            else:
                self.sums[key] = self.sums.get(key, 0.0) + value
                self.counts[key] = self.counts.get(key, 0) + 1

    def result(self) -> dict[str, float]:
        return {**{k: self.sums[k] / self.counts[k] for k in self.sums}, **self.extremes}


def group_state(group: Group) -> dict:
    """group as tensors and plain types (every field of Group, so none is left out as fields are added)."""
    state = {f.name: getattr(group, f.name) for f in fields(Group)}
    return {**state, "version": int(group.version), "index": int(group.index), "reward_extra": dict(group.reward_extra)}


def group_from_state(state: dict) -> Group:
    return Group(**state)


@dataclass
class HeldBatch:
    """A later mini-batch of the cycle, taken and scored ahead at trigger 0, waiting for its trigger."""

    groups: list[Group]
    prox_logp: torch.Tensor  # (B, R) fp32: log pi_old of collate(groups), scored with the cycle-start weights
    # (N,) fp32: the rewards of every group drawn for it, the dropped ones too (algorithm.filter_groups); None: its
    # groups' own
    taken_scores: torch.Tensor | None = None

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def to_state(self) -> dict:
        return {
            "groups": [group_state(g) for g in self.groups],
            "prox_logp": self.prox_logp,
            "taken_scores": self.taken_scores,
        }

    @staticmethod
    def from_state(state: dict) -> HeldBatch:
        return HeldBatch([group_from_state(g) for g in state["groups"]], state["prox_logp"], state.get("taken_scores"))


@dataclass
class Draw:
    """The groups one trigger took from the rollout through algorithm.filter_groups (dppo.trainer.filter_groups):
    every group taken, in the order taken, which of them were kept, and the counts of the takes."""

    taken: list[Group] = field(default_factory=list)
    kept: list[bool] = field(default_factory=list)  # per taken group: its metric varies (or no filter)
    dropped: int = 0  # groups the takes dropped as too stale (replay.max_off_policy_strategy=drop)
    discarded: int = 0  # taken groups the rollout was told the trainer does not train on (rollout.discard)

    @property
    def num_kept(self) -> int:
        return sum(self.kept)

    def taken_scores(self) -> torch.Tensor:
        """(N,) the rewards of every response of every group taken, in the order taken."""
        return torch.cat([g.scores for g in self.taken])

    def groups(self, size: int) -> list[Group]:
        """What the trigger trains on: the kept groups, or, if none was kept, the last size groups taken."""
        kept = [g for g, k in zip(self.taken, self.kept) if k]
        return kept or self.taken[-size:]

    def to_state(self) -> dict:
        return {
            "taken": [group_state(g) for g in self.taken],
            "kept": list(self.kept),
            "dropped": self.dropped,
            "discarded": self.discarded,
        }

    @staticmethod
    def from_state(state: dict) -> Draw:
        return Draw(
            [group_from_state(g) for g in state["taken"]],
            [bool(k) for k in state["kept"]],
            int(state["dropped"]),
            int(state["discarded"]),
        )


@dataclass
class CycleProgress:
    """How far the current sync cycle has got; committed trigger by trigger, so a failure never tears it."""

    trigger: int = 0  # triggers (optimizer steps) of this cycle done
    ended: bool = False  # end_cycle() has run (all triggers done; the weights not yet published)
    metrics: CycleMetrics = field(default_factory=CycleMetrics)
    staleness: list[torch.Tensor] = field(default_factory=list)  # (G,) long per trigger
    scores: list[torch.Tensor] = field(default_factory=list)  # (G n,) fp32 per trigger: of every group it took
    dropped: int = 0
    elapsed_s: float = 0.0  # time the cycle had taken before the run stopped (resumed cycles only)
    ahead: list[HeldBatch] = field(default_factory=list)  # the next triggers' mini-batches, taken and scored ahead
    # the mini-batch after them, which score-ahead began to draw through algorithm.filter_groups but could not fill
    # from the groups that had arrived: its trigger draws the rest (its groups are accounted as taken already)
    pending: Draw | None = None

    @property
    def started(self) -> bool:
        return self.trigger > 0 or self.ended

    def record(self, step: int, version: int, stats: dict[str, float], step_s: float) -> dict[str, float]:
        """The metrics record of the finished cycle: global step `step`, now at `version`; stats: the rollout's."""
        stale = torch.cat(self.staleness).float()
        score = torch.cat(self.scores)
        record = {"step": step, "version": version}
        record.update({
            "critic/score/mean": float(score.mean()),
            "critic/score/max": float(score.max()),
            "critic/score/min": float(score.min()),
            "staleness/mean": float(stale.mean()),
            "staleness/max": float(stale.max()),
            "replay/dropped": float(self.dropped),
        })  # fmt: skip
        record.update(self.metrics.result())
        record.update(stats)
        record["timing_s/step"] = step_s
        return record

    def to_state(self, elapsed_s: float) -> dict:
        return {
            "trigger": self.trigger,
            "ended": self.ended,
            "sums": dict(self.metrics.sums),
            "counts": dict(self.metrics.counts),
            "extremes": dict(self.metrics.extremes),
            "staleness": list(self.staleness),
            "scores": list(self.scores),
            "dropped": self.dropped,
            "elapsed_s": elapsed_s,
            "ahead": [held.to_state() for held in self.ahead],
            "pending": None if self.pending is None else self.pending.to_state(),
        }

    @staticmethod
    def from_state(state: dict) -> CycleProgress:
        metrics = CycleMetrics(dict(state["sums"]), dict(state["counts"]), dict(state["extremes"]))
        ahead = [HeldBatch.from_state(held) for held in state.get("ahead", [])]  # none before score-ahead existed
        pending = None if state.get("pending") is None else Draw.from_state(state["pending"])
        return CycleProgress(
            int(state["trigger"]),
            bool(state["ended"]),
            metrics,
            list(state["staleness"]),
            list(state["scores"]),
            int(state["dropped"]),
            float(state["elapsed_s"]),
            ahead,
            pending,
        )


# ---- where the rollout picks up -------------------------------------------------------------------------


@dataclass
class RolloutStart:
    """Where a (new) rollout source starts: the policy version, the grant indices, and its running counters.

    Groups are identified by their grant index in the replay buffer, and a group's prompts and samples are
    drawn from (trainer.seed, grant index): a resumed run generates the groups the uninterrupted run would
    have, and never one the checkpointed run had already trained on again.
    """

    version: int = 0
    # groups the trainer has consumed before this start (taken to train on, held ahead too): the replay
    # buffer's wait budget counts from it. Fewer than B a version where algorithm.filter_groups' limit left a
    # trigger fewer than G groups, so a checkpoint keeps the count rather than computing it
    consumed: int = 0
    next_grant: int = 0  # grant index of the first group this start grants (one past the last one taken)
    dropped_total: int = 0
    worker_restarts: int = 0

    def to_state(self) -> dict:
        return {
            "consumed": self.consumed,
            "next_grant": self.next_grant,
            "dropped_total": self.dropped_total,
            "worker_restarts": self.worker_restarts,
        }

    @staticmethod
    def from_state(state: dict, version: int) -> RolloutStart:
        """The start to_state() described, at the policy version the run continues at."""
        return RolloutStart(
            version,
            int(state["consumed"]),
            int(state["next_grant"]),
            int(state["dropped_total"]),
            int(state["worker_restarts"]),
        )

    def took(self, version: int, groups: list[Group], dropped: int, discarded: int = 0) -> None:
        """The trainer at `version` took these groups (and the rollout dropped `dropped` meanwhile); discarded: how many
        of them it told the rollout it does not train on (algorithm.filter_groups)."""
        self.version = version
        self.consumed += len(groups) - discarded
        self.next_grant = max([self.next_grant, *(g.index + 1 for g in groups)])
        self.dropped_total += dropped


@dataclass
class TrainerState:
    """Where a run is: what the trainer's loop moves and a checkpoint keeps (with the RNG states, dppo.rng)."""

    global_step: int = 0  # completed global steps (sync cycles)
    version: int = 0  # policy version of the live weights' last sync to the rollout
    progress: CycleProgress = field(default_factory=CycleProgress)  # of the current cycle
    rollout_start: RolloutStart = field(default_factory=RolloutStart)  # where a new rollout picks up

    def to_state(self, cycle_elapsed_s: float) -> dict:
        """The state as a checkpoint's trainer file holds it (plain values and tensors): global_step, version,
        trigger, rollout, and where the cycle has started, cycle (with the time it has taken so far)."""
        state = {
            "global_step": self.global_step,
            "version": self.version,
            "trigger": self.progress.trigger,
            "rollout": self.rollout_start.to_state(),
        }
        if self.progress.started:
            state["cycle"] = self.progress.to_state(cycle_elapsed_s)
        return state

    @staticmethod
    def from_state(state: dict) -> TrainerState:
        """The state to_state() described (a checkpoint's, in the current layout: dppo.checkpoint.run reads older ones
        into it)."""
        version = int(state["version"])
        progress = CycleProgress.from_state(state["cycle"]) if "cycle" in state else CycleProgress()
        return TrainerState(
            int(state["global_step"]), version, progress, RolloutStart.from_state(state["rollout"], version)
        )
