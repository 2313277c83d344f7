"""Dynamic sampling (DAPO; verl's algorithm.filter_groups): how a trigger draws its mini-batch from the rollout.

A group whose metric is the same for all its responses has zero advantage under every group-relative estimator:
it teaches nothing, and late in a run, when the policy answers most prompts the same way every time, most groups
are such. With the filter on, a trigger drops them and takes more groups until its mini-batch is full:

    kept(group) = not (n > 1 and std(metric of its n responses) == 0)      verl 0.9.1's rule (its ReplayBuffer)
    draw:  while fewer than G groups are kept and fewer than limit x G were taken:
               take min(G - kept, limit x G - taken) more groups, in the order the rollout grants them
           train on the kept ones; if the limit was reached with none kept:
               max_num_gen_batches > 0: on the last G groups taken
               else (the default limit):  NothingKeptError, after a checkpoint

G is the trigger's mini-batch (trainer.train_batch_size / parameter_sync_step groups) and limit is
max_num_gen_batches, or DEFAULT_MAX_BATCHES where that is 0 or less. verl's DAPO draws whole generation batches and
throws the surplus of kept groups away; dppo's rollout is a stream of groups, so a trigger takes only the ones still
missing and limit counts mini-batches' worth of groups.

verl draws without end when max_num_gen_batches <= 0: a constant reward, or a policy that answers every prompt
alike, then hangs the run with no line and no metric. dppo bounds that draw at DEFAULT_MAX_BATCHES (the limit of
verl's own DAPO recipe). A trigger that reaches this default limit with some groups kept trains on them, a smaller
mini-batch (one warning line per step, filter_groups/at_limit); one that kept none stops the run, since with no
limit set the run asked to learn only from groups that vary, and DEFAULT_MAX_BATCHES mini-batches' worth without
one means every later update would have zero advantage. An explicit max_num_gen_batches is the user's choice of cost: at it the
trigger trains on what it kept, or on the last mini-batch taken (the update the run without the filter makes).

Staleness is as without the filter: the replay buffer drops the groups too stale for the trainer's version before
it hands any out, and the trainer records the staleness of the groups it trains on. Every group taken is accounted
as taken (RolloutStart.next_grant: a resumed run picks up after it), and the groups trained on as consumed
(RolloutStart.consumed). The rollout is told, at once, of every taken group the trigger will not train on
(rollout.discard): under replay.max_off_policy_strategy=wait the buffer lets its workers run ahead by a number of
groups the trainer trains on, and a dropped group must free its place there as a stale one does, else the trainer
would wait for groups the buffer never grants. A fetch's dropped groups are told at once unless that fetch ends a
draw that kept none (those are the groups it trains on).

The metrics of a step (with the filter on), over its triggers' draws:
    filter_groups/draws      groups a trigger took / G: the mini-batches' worth it drew (verl's num_gen_batches;
                             1.0 where it dropped none, at most the limit), the mean over the step's triggers
    filter_groups/kept_frac  groups a trigger kept / groups it took, the mean over the step's triggers
    filter_groups/at_limit   triggers of the step whose draw reached the limit with fewer than G groups kept (each
                             trained on fewer than G groups, or on the last G taken where it kept none), summed

With the filter off a draw is one fetch of G groups, all kept: the loop takes exactly what it took before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from dppo.config.choices import FILTER_REWARD_METRICS
from dppo.data import DataError
from dppo.batch import Group
from dppo.trainer.state import Draw, TrainerState

log = logging.getLogger("dppo.trainer")

# told of every take: ("fetch" or "ready", groups asked for, what the rollout returned: (groups, dropped) or None)
TakeHook = Callable[[str, int, tuple[list[Group], int] | None], None]

# max_num_gen_batches <= 0 (verl: no limit): the most mini-batches' worth of groups a trigger draws all the same
DEFAULT_MAX_BATCHES = 10


class FilterMetricError(DataError, KeyError):
    """algorithm.filter_groups.metric names a value the reward function did not return for a group's responses."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


class NothingKeptError(DataError, RuntimeError):
    """With no algorithm.filter_groups.max_num_gen_batches set, a trigger drew DEFAULT_MAX_BATCHES mini-batches' worth
    of groups and kept none: the run stops (after a checkpoint) instead of drawing without end."""


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

    def __init__(self, filter_cfg, groups_per_trigger: int, on_take: TakeHook | None = None) -> None:
        """filter_cfg: algorithm.filter_groups; groups_per_trigger: G; on_take(call, want, got): told of every take
        (call "fetch" or "ready", the groups asked for and what the rollout returned): the run's schedule."""
        self.on_take = on_take
        self.enabled = filter_cfg.enable
        self.metric = filter_cfg.metric
        self.size = groups_per_trigger
        self.max_num_gen_batches = filter_cfg.max_num_gen_batches
        self.default_limit = filter_cfg.max_num_gen_batches <= 0  # the limit is DEFAULT_MAX_BATCHES, not the user's
        batches = DEFAULT_MAX_BATCHES if self.default_limit else filter_cfg.max_num_gen_batches
        self.limit = batches * groups_per_trigger  # the most groups a trigger takes
        self._warned_step = -1  # global_step of the step whose at-limit trigger was last warned of

    def done(self, draw: Draw) -> bool:
        """The draw has its mini-batch: G groups kept, or the limit's groups taken."""
        return draw.num_kept >= self.size or len(draw.taken) >= self.limit

    def at_limit(self, draw: Draw) -> bool:
        """A done draw that reached the limit before G groups were kept."""
        return draw.num_kept < self.size

    def fetch(self, rollout, version: int, pending: Draw | None = None) -> Draw:
        """A whole draw, waiting for the groups (rollout.fetch), continuing pending (the groups score-ahead took for
        this trigger at trigger 0) if given; NothingKeptError if it reached the default limit with none kept."""
        draw = _copy(pending)
        while not self.done(draw):
            wanted = self._wanted(draw)
            got = rollout.fetch(wanted, version)
            self._took("fetch", wanted, got)
            self._add(rollout, draw, got)
        self._check(draw)
        return draw

    def fetch_ready(self, rollout, version: int) -> Draw:
        """A draw from the groups that have arrived only (rollout.fetch_ready, at trigger 0: score-ahead); it stops at
        the first take that is not all there, so it may be partial (not done(); nothing taken if its first take was
        not there). NothingKeptError as fetch."""
        draw = Draw()
        while not self.done(draw):
            wanted = self._wanted(draw)
            got = rollout.fetch_ready(wanted, version)
            self._took("ready", wanted, got)
            if got is None:
                return draw
            self._add(rollout, draw, got)
        self._check(draw)
        return draw

    def commit(self, state: TrainerState, draw: Draw, since: Draw | None = None) -> None:
        """A done draw of a trigger's mini-batch into the run's state: its groups taken and dropped since `since`
        (what score-ahead had taken of it at trigger 0, committed then) and its filter_groups/* metrics; a warning
        line for the step's first trigger that trains on fewer than G groups at the default limit."""
        before = since or Draw()
        dropped = draw.dropped - before.dropped
        state.progress.dropped += dropped
        state.progress.metrics.add(self.metrics(draw))
        state.rollout_start.took(
            state.version, draw.taken[len(before.taken) :], dropped, draw.discarded - before.discarded
        )
        if self.enabled and self.default_limit and self.at_limit(draw) and self._warned_step != state.global_step:
            self._warned_step = state.global_step
            log.warning(
                f"step {state.global_step + 1}: a trigger kept {draw.num_kept} of the {len(draw.taken)} groups it "
                f"drew ({DEFAULT_MAX_BATCHES} mini-batches' worth, algorithm.filter_groups' limit where "
                f"max_num_gen_batches={self.max_num_gen_batches} sets none) and trains on them instead of "
                f"{self.size}; filter_groups/at_limit counts such triggers per step"
            )

    def metrics(self, draw: Draw) -> dict[str, float]:
        """filter_groups/draws, filter_groups/kept_frac and filter_groups/at_limit of a done draw (defined in the
        module docstring); none with the filter off."""
        if not self.enabled:
            return {}
        return {
            "filter_groups/draws": len(draw.taken) / self.size,
            "filter_groups/kept_frac": draw.num_kept / len(draw.taken),
            "filter_groups/at_limit": float(self.at_limit(draw)),
        }

    def _took(self, call: str, wanted: int, got) -> None:
        if self.on_take is not None:
            self.on_take(call, wanted, got)

    def _wanted(self, draw: Draw) -> int:
        return min(self.size - draw.num_kept, self.limit - len(draw.taken))

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

    def _check(self, draw: Draw) -> None:
        """NothingKeptError if a done draw reached the default limit with none kept."""
        if self.enabled and self.default_limit and draw.num_kept == 0:
            raise NothingKeptError(
                f"algorithm.filter_groups kept none of the {len(draw.taken)} groups a trigger drew "
                f"({DEFAULT_MAX_BATCHES} mini-batches' worth, its limit where max_num_gen_batches="
                f"{self.max_num_gen_batches} sets none): {self.metric} was the same for every response of each "
                "(a constant reward, or a policy that answers these prompts alike); set "
                "algorithm.filter_groups.max_num_gen_batches > 0 to train on the last mini-batch at that limit "
                "instead, or enable=false"
            )


def _copy(draw: Draw | None) -> Draw:
    return Draw() if draw is None else Draw(list(draw.taken), list(draw.kept), draw.dropped, draw.discarded)
