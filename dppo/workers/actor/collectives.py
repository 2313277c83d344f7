"""What the actor's ranks exchange besides FSDP2's own traffic: the loss normalizers and the metrics of a step.

RankGroup is this rank's view of the group; alone (world size 1) every exchange is a no-op, so rank-local
code calls it unconditionally.

Metrics: each rank reports values that are its SHARE of the whole mini-batch's value (a micro-batch's loss
metrics weighted by its share of the global normalizer; means over this rank's tokens weighted by its share
of the global tokens), so summing over the ranks gives the value world size 1 would report. Extremes and
times are combined by reduce_rule.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

SUM, MAX, MIN = "sum", "max", "min"
SAME_ON_EVERY_RANK = ("actor/grad_norm", "actor/step_skipped", "actor/skipped_updates", "actor/lr")


def reduce_rule(key: str, default: str = SUM) -> str:
    """How a metric combines over ranks: timing_s/* and *_max take the largest, *_min the smallest, the grad
    norm, the lr and the skipped-step flags are the same on every rank (largest), the rest `default`."""
    if key.startswith("timing_s/") or key.endswith("_max") or key in SAME_ON_EVERY_RANK:
        return MAX
    if key.endswith("_min"):
        return MIN
    return default


def combine(per_rank: list[dict[str, float]], default: str = SUM) -> dict[str, float]:
    """Every rank's metrics combined key by key (reduce_rule); a key some rank lacks counts as absent there."""
    out: dict[str, float] = {}
    for metrics in per_rank:
        for key, value in metrics.items():
            if key not in out:
                out[key] = value
                continue
            rule = reduce_rule(key, default)
            out[key] = (
                out[key] + value if rule == SUM else max(out[key], value) if rule == MAX else min(out[key], value)
            )
    return out


def as_share(metrics: dict[str, float], token_share: float) -> dict[str, float]:
    """Means over this rank's tokens as shares of the mean over the whole mini-batch (token_share: this rank's
    fraction of its valid tokens); extremes stay as they are. A rank without valid tokens reports nothing."""
    if token_share == 0:
        return {}
    return {key: value * token_share if reduce_rule(key) == SUM else value for key, value in metrics.items()}


class RankGroup:
    """This rank's place among world_size actor ranks (torch.distributed's default group when world_size > 1)."""

    def __init__(self, rank: int = 0, world_size: int = 1, device: torch.device | str = "cpu") -> None:
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)  # where the process group's collectives run (NCCL: the rank's GPU)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of tensor over the ranks (tensor itself alone)."""
        if not self.distributed:
            return tensor

        out = tensor.to(self.device, copy=True)
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out.to(tensor.device)

    def reduce_metrics(self, metrics: dict[str, float], default: str = SUM) -> dict[str, float]:
        """Every rank's metrics combined (see combine); each rank gets the same dict."""
        if not self.distributed:
            return metrics

        gathered: list[dict[str, float] | None] = [None] * self.world_size
        dist.all_gather_object(gathered, metrics)
        return combine([g for g in gathered if g is not None], default)
