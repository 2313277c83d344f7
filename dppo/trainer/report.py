"""What a run leaves behind: metrics.jsonl (one object per global step), a PNG plot and a summary."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from dppo.checkpoint.store import atomic_write_bytes

TIME_PARTS = ("timing_s/gen_wait", "timing_s/old_log_prob", "timing_s/update_actor", "timing_s/weight_sync")


class MetricsLog:
    """Appends one JSON object per global step to path; on resume, drops steps after the checkpoint."""

    def __init__(self, path: str | os.PathLike, resume_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.records: list[dict] = []
        if resume_step is not None and self.path.exists():
            self.records = [r for r in read_metrics(self.path) if r["step"] <= resume_step]
            text = "".join(json.dumps(r) + "\n" for r in self.records).encode()
            atomic_write_bytes(self.path, lambda f: f.write(text))
        elif self.path.exists():
            self.path.unlink()
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self.records.append(record)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def amend_last(self, values: dict) -> None:
        """Merge values into the last record and rewrite the file atomically (the final evaluation joins the
        last step's line; the file must be closed)."""
        self.records[-1] = {**self.records[-1], **values}
        text = "".join(json.dumps(r) + "\n" for r in self.records).encode()
        atomic_write_bytes(self.path, lambda f: f.write(text))

    def close(self) -> None:
        self._file.close()


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a metrics.jsonl; a torn last line (a run killed mid-write) is skipped."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return records


def tail_mean(records: list[dict], key: str, fraction: float = 0.1, head: bool = False) -> float:
    """Mean of key over the last (or first, head=True) fraction of the records, at least one record."""
    values = [r[key] for r in records if key in r]
    if not values:
        return math.nan
    count = max(1, round(len(values) * fraction))
    part = values[:count] if head else values[-count:]
    return sum(part) / len(part)


def plot_run(records: list[dict], path: str | os.PathLike, evaluation: dict[str, float] | None = None) -> Path:
    """Reward (and the final greedy eval reward) and the per-step time breakdown over global steps, as a PNG."""
    import matplotlib  # heavy (a second or more), and only the final plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, (ax_reward, ax_time) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    ax_reward.plot(steps, [r["critic/score/mean"] for r in records], label="mean sampled reward")
    if evaluation and "eval/reward" in evaluation:
        ax_reward.axhline(evaluation["eval/reward"], ls="--", c="gray", label="greedy eval reward (end)")
    for key in sorted({k for r in records for k in r if k.startswith("val/score/")}):
        points = [(r["step"], r[key]) for r in records if key in r]
        ax_reward.plot(*zip(*points), "o--", label=f"greedy {key}")
    ax_reward.set_ylabel("reward")
    ax_reward.set_ylim(0, 1.02)
    ax_reward.grid(alpha=0.3)
    ax_reward.legend(loc="lower right")

    bottom = [0.0] * len(records)
    for key in TIME_PARTS:
        values = [r.get(key, 0.0) for r in records]
        ax_time.bar(steps, values, bottom=bottom, label=key.split("/")[1], width=0.9)
        bottom = [b + v for b, v in zip(bottom, values)]
    other = [max(0.0, r["timing_s/step"] - b) for r, b in zip(records, bottom)]
    ax_time.bar(steps, other, bottom=bottom, label="other", width=0.9, color="lightgray")
    ax_time.set_xlabel("global step")
    ax_time.set_ylabel("seconds per step")
    ax_time.grid(alpha=0.3)
    ax_time.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def summarize(records: list[dict], evaluation: dict[str, float], wall_s: float) -> list[tuple[str, str]]:
    """(label, value) rows for the terminal summary and summary.json."""

    def fmt(x: float, digits: int = 3) -> str:
        return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"

    step_times = [r["timing_s/step"] for r in records]
    rows = [
        ("global steps", str(records[-1]["step"] if records else 0)),
        ("wall time (s)", fmt(wall_s, 1)),
        ("reward, first 10% of steps", fmt(tail_mean(records, "critic/score/mean", head=True))),
        ("reward, last 10% of steps", fmt(tail_mean(records, "critic/score/mean"))),
        *_evaluation_rows(evaluation, fmt),
        ("mean step time (s)", fmt(sum(step_times) / len(step_times) if step_times else math.nan)),
        ("mean staleness", fmt(tail_mean(records, "staleness/mean", fraction=1.0), 2)),
        ("max staleness", fmt(max((r["staleness/max"] for r in records), default=math.nan), 0)),
        ("groups dropped", fmt(records[-1].get("replay/dropped_total", 0.0) if records else math.nan, 0)),
    ]
    for key in (*TIME_PARTS, "timing_s/snapshot"):
        rows.append((f"total {key.split('/')[1]} (s)", fmt(sum(r.get(key, 0.0) for r in records), 2)))
    return rows


def _evaluation_rows(evaluation: dict[str, float], fmt) -> list[tuple[str, str]]:
    """The final greedy evaluation: val/score/<data_source> of text data, else a task's reward and exact match."""
    val = sorted((key, value) for key, value in evaluation.items() if key.startswith("val/"))
    if val:
        return [(f"greedy {key}", fmt(value)) for key, value in val]
    return [
        ("greedy eval reward", fmt(evaluation.get("eval/reward", math.nan))),
        ("greedy eval exact match", fmt(evaluation.get("eval/accuracy", math.nan))),
    ]


def format_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"  {label:<{width}}  {value}" for label, value in rows)
