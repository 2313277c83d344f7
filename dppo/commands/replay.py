"""`dppo replay RUN_DIR`: train again along a run's schedule, and say whether it ended where the run did.

    dppo replay RUN_DIR [--until STEP] [--out DIR] [--samples] [key=value ...]

The replay is a run of its own (in --out, default RUN_DIR/replay or RUN_DIR/replay_samples) from the run's config
(its config.yaml) and the key=value overrides, whose groups come from the run's schedule (ScheduledRollout): every
ticket generated again with its recorded version, seed and mid-ticket switches, every take at its recorded trigger.
--samples trains on the run's stored groups instead (trainer.record_samples), so an override of the loss, the
correction or the prox method re-trains the very same samples. --until STEP stops after global step STEP and
checkpoints there (trainer.resume=true in --out continues it; dppo export and dppo eval read it).

At the end the replay is compared with the run: the final weights tensor by tensor (the run's hf_model/, or its
checkpoint's at --until), and metrics.jsonl step by step, every key but the ones that measure time or the moment
(MOMENT_KEYS). Without overrides a replay that differs is exit code 7; with them the comparison is what they changed.
Keys that the schedule fixes (FIXED_BY_SCHEDULE) cannot be overridden: the takes would not be the run's.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch
from safetensors.torch import load_file

from dppo.checkpoint.hf_model import CHECKPOINT_HF_DIR
from dppo.checkpoint.layout import ACTOR_DIR
from dppo.checkpoint.store import CheckpointId
from dppo.config import ConfigError, DppoConfig, load_config
from dppo.data.source import PromptSource
from dppo.launch.run import run
from dppo.models import policy_config
from dppo.trainer.report import read_metrics
from dppo.trainer.rollout.scheduled import ScheduledRollout, samples_dir
from dppo.trainer.schedule import Schedule, ScheduleError

# Keys whose value the schedule fixes: an override would make the replay's takes another run's.
FIXED_BY_SCHEDULE = (
    "trainer.train_batch_size",
    "trainer.parameter_sync_step",
    "trainer.seed",
    "trainer.mode",
    "trainer.total_steps",  # --until
    "trainer.output_dir",  # --out
    "trainer.resume",
    "rollout.n",
    "rollout.groups_per_batch",
    "rollout.partial_rollout",
    "rollout.partial_chunk",
    "rollout.agent",
    "replay.",
    "algorithm.filter_groups",
    "task.",
    "data.",
)
# Metrics of time or of the moment (how far the workers had run ahead, what the recording cost): not compared.
MOMENT_PREFIXES = ("timing_s/", "perf/", "memory/")
MOMENT_KEYS = frozenset({
    "replay/size",
    "replay/in_flight",
    "replay/regranted_total",
    "rollout/worker_restarts",
    "rollout/weight_sync_bytes",
    "rollout/weight_sync_changed_frac",
    "schedule/bytes",
})  # fmt: skip


@dataclass
class ReplayResult:
    run_dir: Path
    out_dir: Path
    steps: int
    tickets: int  # tickets generated (0 with --samples)
    counterfactual: bool  # overrides were given: differences are what they changed
    weights: str  # the weights' comparison in words
    weights_equal: bool | None  # None: not compared
    metric_differences: list[str] = field(default_factory=list)
    metric_keys: int = 0

    @property
    def equal(self) -> bool:
        return self.weights_equal is not False and not self.metric_differences

    def lines(self) -> list[str]:
        metrics = (
            f"metrics: equal at steps 1-{self.steps} ({self.metric_keys} keys compared; times left out)"
            if not self.metric_differences
            else f"metrics: {len(self.metric_differences)} difference(s); first: {self.metric_differences[0]}"
        )
        return [f"weights: {self.weights}", metrics]


def check_overrides(overrides: list[str]) -> None:
    """ConfigError for an override of a key the schedule fixes."""
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        for fixed in FIXED_BY_SCHEDULE:
            if key == fixed or key.startswith(fixed if fixed.endswith(".") else fixed + "."):
                why = {"trainer.total_steps": " (use --until)", "trainer.output_dir": " (use --out)"}.get(fixed, "")
                raise ConfigError(f"dppo replay: {key} is fixed by the run's schedule and cannot be overridden{why}")


def replay_config(run_dir: Path, out_dir: Path, overrides: list[str]) -> DppoConfig:
    """The run's config with the overrides, writing to out_dir (trainer.total_steps stays the run's: the lr schedule
    counts with it)."""
    ours = [f"trainer.output_dir={out_dir}", "trainer.resume=false", "trainer.record_samples=false"]
    return load_config([*ours, *overrides], config_file=run_dir / "config.yaml")


def replay(
    run_dir: str | Path,
    until: int | None = None,
    out: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    samples: bool = False,
    stdout: TextIO | None = None,
) -> ReplayResult:
    """Replay run_dir's schedule (see the module docstring); the comparison with the run."""
    stdout = sys.stdout if stdout is None else stdout
    run_dir, overrides = Path(run_dir), list(overrides)
    check_overrides(overrides)
    out_dir = Path(out) if out is not None else run_dir / ("replay_samples" if samples else "replay")
    if out_dir.resolve() == run_dir.resolve():
        raise ConfigError(f"dppo replay: --out {str(out_dir)!r} is the run's own directory; pick another")
    if not (run_dir / "config.yaml").is_file():
        raise ScheduleError(f"{str(run_dir)!r} has no config.yaml: not a dppo run directory")
    run_cfg = load_config([], config_file=run_dir / "config.yaml")
    whole = complete_steps(Schedule.read(run_dir), run_cfg.trainer.parameter_sync_step)
    if whole == 0:
        raise ScheduleError(f"{str(run_dir / 'schedule.jsonl')!r} holds no whole step: nothing to replay")
    until = whole if until is None else until
    if not 1 <= until <= whole:
        raise ScheduleError(f"--until {until}: the run's schedule holds global steps 1-{whole}")
    if samples and not samples_dir(run_dir).is_dir():
        raise ScheduleError(
            f"{str(run_dir)!r} has no samples/: the run did not record them (trainer.record_samples=true)"
        )
    schedule = Schedule.read(run_dir, until)
    cfg = replay_config(run_dir, out_dir, overrides)
    made: list[ScheduledRollout] = []

    def rollout_of(cfg: DppoConfig, source: PromptSource) -> ScheduledRollout:
        model_config = policy_config(cfg.model, source.vocab_size)
        made.append(ScheduledRollout(cfg, source, model_config, schedule, samples_dir(run_dir) if samples else None))
        return made[0]

    print(f"replaying {run_dir} ({until} step(s), {len(schedule.tickets)} tickets) into {out_dir}", file=stdout)
    run(cfg, stdout, rollout_of, stop_after=until)
    result = compare(run_dir, out_dir, until, whole)
    result.tickets = made[0].tickets_generated if made else 0
    result.counterfactual = bool(overrides)
    return result


def complete_steps(schedule: Schedule, triggers: int) -> int:
    """The global steps whose every trigger the schedule holds, from the first: where a replay may stop."""
    seen: dict[int, set[int]] = {}
    for line in schedule.lines:
        seen.setdefault(line["step"], set()).add(line["trigger"])
    step = 0
    while seen.get(step + 1) == set(range(triggers)):
        step += 1
    return step


def compare(run_dir: Path, out_dir: Path, steps: int, run_steps: int) -> ReplayResult:
    """The replay in out_dir against the run in run_dir, over global steps 1..steps."""
    result = ReplayResult(run_dir, out_dir, steps, 0, False, "", None)
    ours = out_dir / "hf_model" / "model.safetensors"
    theirs = (
        run_dir / "hf_model" / "model.safetensors"
        if steps == run_steps
        else run_dir / "checkpoints" / CheckpointId(steps).name / ACTOR_DIR / CHECKPOINT_HF_DIR / "model.safetensors"
    )
    if not theirs.is_file() or not ours.is_file():
        result.weights = (
            f"not compared (no weights of step {steps} in {theirs.parent if not theirs.is_file() else ours.parent})"
        )
    else:
        result.weights, result.weights_equal = _compare_weights(load_file(theirs), load_file(ours))
    run_records = {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl") if "step" in r}
    replay_records = {r["step"]: r for r in read_metrics(out_dir / "metrics.jsonl") if "step" in r}
    keys = set()
    for step in range(1, steps + 1):
        a, b = run_records.get(step), replay_records.get(step)
        if a is None or b is None:
            result.metric_differences.append(f"step {step}: no record in the {'run' if a is None else 'replay'}")
            continue
        for key in sorted(set(a) | set(b)):
            if key.startswith(MOMENT_PREFIXES) or key in MOMENT_KEYS:
                continue
            if step == steps < run_steps and key not in a:
                continue  # the replay's final evaluation, at a step where the run did not evaluate
            keys.add(key)
            if key not in a or key not in b:
                result.metric_differences.append(f"step {step} {key}: only in the {'replay' if key in b else 'run'}")
            elif not _same(a[key], b[key]):
                result.metric_differences.append(f"step {step} {key}: run {a[key]!r}, replay {b[key]!r}")
    result.metric_keys = len(keys)
    return result


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _compare_weights(theirs: dict, ours: dict) -> tuple[str, bool]:
    if set(theirs) != set(ours):
        return f"differ: tensors {sorted(set(theirs) ^ set(ours))[:3]} are in one only", False
    for name in sorted(theirs):
        a, b = theirs[name], ours[name]
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"differ at {name} ({a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)})", False
        if not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):  # bitwise
            diff = float((a.double() - b.double()).abs().max())
            return f"differ first at {name} (max |run - replay| {diff:.3g})", False
    return f"bitwise equal ({len(theirs)} tensors)", True
