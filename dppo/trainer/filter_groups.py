"""Dynamic sampling (DAPO; verl's algorithm.filter_groups): how a trigger draws its mini-batch from the rollout.

A group whose metric is the same for all its responses has zero advantage under every group-relative estimator:
it teaches nothing, and late in a run, when the policy answers most prompts the same way every time, most groups
are such. With the filter on, a trigger drops them and takes more groups until its mini-batch is full:

    kept(group) = not (n > 1 and std(metric of its n responses) == 0)      verl 0.9.1's rule (its ReplayBuffer)
    draw:  while fewer than G groups are kept and fewer than limit x G were taken:
               take min(G - kept, limit x G - taken) more groups, in the order the rollout grants them
           train on the kept ones; if the limit was reached with none kept, on the last G groups taken

G is the trigger's mini-batch (trainer.train_batch_size / parameter_sync_step groups) and limit is
max_num_gen_batches (<= 0: none). verl's DAPO draws whole generation batches and throws the surplus of kept groups
away; dppo's rollout is a stream of groups, so a trigger takes only the ones still missing and limit counts
mini-batches' worth of groups.

Staleness is as without the filter: the replay buffer drops the groups too stale for the trainer's version before
it hands any out, and the trainer records the staleness of the groups it trains on. Every group taken is accounted
as taken (RolloutStart.next_grant: a resumed run picks up after it). The rollout is told, at once, of every taken
group the trigger will not train on (rollout.discard): under replay.max_off_policy_strategy=wait the buffer lets its
workers run ahead by a number of groups the trainer trains on, and a dropped group must free its place there as a
stale one does, else the trainer would wait for groups the buffer never grants. A fetch's dropped groups are told
at once unless that fetch ends a draw that kept none (those are the groups it trains on).

With the filter off a draw is one fetch of G groups, all kept: the loop takes exactly what it took before.
"""

from __future__ import annotations

import numpy as np

from dppo.config.choices import FILTER_REWARD_METRICS
from dppo.data import DataError
from dppo.batch import Group
from dppo.checkpoint.state import Draw, TrainerState


class FilterMetricError(DataError, KeyError):
    """algorithm.filter_groups.metric names a value the reward function did not return for a group's responses."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


def metric_values(group: Group, metric: str) -> np.ndarray:
    """The group's metric, one float64 per response (n,): its rewards, or an extra output of the reward function."""
    if metric in FILTER_REWARD_METRICS:
        return group.scores.double().numpy()
    values = group.reward_extra.get(metric)
    if values is None or bool(values.isnan().any()):
        have = ", ".join(sorted(group.reward_extra)) or "none"
        raise FilterMetricError(
            f"algorithm.filter_groups.metric={metric!r}: the reward function returned no {metric!r} "
            f"for some response of group {group.index} (its extra outputs: {have})"
        )
    return values.double().numpy()


def keeps(group: Group, metric: str) -> bool:
    """Whether the group is kept: it has one response, or its metric is not the same for all of them (verl's test:
    np.std of the values == 0 drops it)."""
    values = metric_values(group, metric)
    return not (len(values) > 1 and float(np.std(values)) == 0.0)


class GroupFilter:
    """Draws a trigger's mini-batch (see the module docstring) from a rollout source (fetch, fetch_ready, discard)."""

    def __init__(self, filter_cfg, groups_per_trigger: int) -> None:
        """filter_cfg: algorithm.filter_groups; groups_per_trigger: G."""
        self.enabled = filter_cfg.enable
        self.metric = filter_cfg.metric
        self.size = groups_per_trigger
        self.limit = max(0, filter_cfg.max_num_gen_batches) * groups_per_trigger  # most groups a trigger takes; 0: any

    def done(self, draw: Draw) -> bool:
        """The draw has its mini-batch: G groups kept, or the limit's groups taken."""
        return draw.num_kept >= self.size or (self.limit > 0 and len(draw.taken) >= self.limit)

    def fetch(self, rollout, version: int, pending: Draw | None = None) -> Draw:
        """A whole draw, waiting for the groups (rollout.fetch), continuing pending (the groups score-ahead took for
        this trigger at trigger 0) if given."""
        draw = _copy(pending)
        while not self.done(draw):
            self._add(rollout, draw, rollout.fetch(self._wanted(draw), version))
        return draw

    def fetch_ready(self, rollout, version: int) -> Draw:
        """A draw from the groups that have arrived only (rollout.fetch_ready, at trigger 0: score-ahead); it stops at
        the first take that is not all there, so it may be partial (not done(); nothing taken if its first take was
        not there)."""
        draw = Draw()
        while not self.done(draw):
            got = rollout.fetch_ready(self._wanted(draw), version)
            if got is None:
                break
            self._add(rollout, draw, got)
        return draw

    def commit(self, state: TrainerState, draw: Draw, since: Draw | None = None) -> None:
        """A done draw of a trigger's mini-batch into the run's state: its groups taken and dropped since `since`
        (what score-ahead had taken of it at trigger 0, committed then) and its filter_groups/* metrics."""
        before = since or Draw()
        dropped = draw.dropped - before.dropped
        state.progress.dropped += dropped
        state.progress.metrics.add(self.metrics(draw))
        state.rollout_start.took(
            state.version, draw.taken[len(before.taken) :], dropped, draw.discarded - before.discarded
        )

    def metrics(self, draw: Draw) -> dict[str, float]:
        """filter_groups/kept_frac (kept / taken) and filter_groups/extra_batches (groups taken beyond the mini-batch,
        in mini-batches) of a done draw; none with the filter off."""
        if not self.enabled:
            return {}
        return {
            "filter_groups/kept_frac": draw.num_kept / len(draw.taken),
            "filter_groups/extra_batches": len(draw.taken) / self.size - 1.0,
        }

    def _wanted(self, draw: Draw) -> int:
        wanted = self.size - draw.num_kept
        return min(wanted, self.limit - len(draw.taken)) if self.limit > 0 else wanted

    def _add(self, rollout, draw: Draw, got: tuple[list[Group], int]) -> None:
        groups, dropped = got
        kept = [keeps(g, self.metric) for g in groups] if self.enabled else [True] * len(groups)
        draw.taken.extend(groups)
        draw.kept.extend(kept)
        draw.dropped += dropped
        filtered = len(groups) - sum(kept)
        if filtered and not (self.done(draw) and draw.num_kept == 0):  # else: the groups the trigger trains on
            rollout.discard(filtered)
            draw.discarded += filtered


def _copy(draw: Draw | None) -> Draw:
    return Draw() if draw is None else Draw(list(draw.taken), list(draw.kept), draw.dropped, draw.discarded)
