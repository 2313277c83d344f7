"""Issue 46's figures: what recording the schedule costs, whether the demo's whole async run replays bitwise, and an A/B
of off-policy corrections on the very same samples.

    python benchmarks/replay_bench.py                          # the demo (60 steps), then its A/B (four replays)
    python benchmarks/replay_bench.py --steps 20 --variants bypass

1. The demo (`make demo`: dppo train with the defaults: separate_async, a local worker process) twice, as a user starts
   it (a subprocess), with trainer.record_samples false and true, and trainer.test_freq evaluations: the schedule's
   cost per step from metrics.jsonl (timing_s/schedule against timing_s/step, schedule/bytes) and the files' sizes.
2. `dppo replay` of the run with samples: weights and metrics against the run's (its lines), and its wall time.
3. `dppo replay --samples` under each correction of VARIANTS (the run's samples, a fresh policy each), evaluated every
   test_freq steps: their held-out greedy accuracy and their training metrics step by step; a figure of the curves.

Writes replay_bench.json and replay_ab.png in --out (default bench_out/replay). About 6 minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

# The corrections compared on the demo's samples (algorithm.rollout_correction.*): the demo's own (Decoupled PPO with
# token-level truncated IS weights pi_prox / pi_behav, truncated at 2), masked IS (weights outside [0.5, 2] zeroed),
# Decoupled PPO with the weights untruncated, and bypass mode (pi_old := pi_behav: PPO's ratio against the behaviour).
VARIANTS = {
    "token-TIS": [],
    "MIS": ["algorithm.rollout_correction.rollout_is_threshold=0.5_2.0"],
    "decoupled": ["algorithm.rollout_correction.rollout_is_threshold=1e9"],
    "bypass": ["algorithm.rollout_correction.bypass_mode=true"],
}
CURVES = (
    "eval/accuracy",
    "actor/pg_clipfrac",
    "rollout_corr/weight_truncated_frac",
    "rollout_corr/weight_zeroed_frac",
    "actor/ppo_kl",
)


def dppo(*args: str) -> tuple[float, str]:
    """`python -m dppo ARGS` as a user runs it: (wall seconds, its stdout); RuntimeError with its last line if it fails."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "dppo", *args], capture_output=True, text=True, check=False)
    wall_s = time.perf_counter() - start
    if proc.returncode not in (0, 7):
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        raise RuntimeError(f"dppo {args[0]} failed: {last}")
    return wall_s, proc.stdout


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def cost(run_dir: Path, wall_s: float) -> dict:
    """The schedule's cost in a run: time against the steps', bytes per step."""
    rows = records(run_dir)
    steps = len(rows)
    schedule_s = [r.get("timing_s/schedule", 0.0) for r in rows]
    step_s = [r["timing_s/step"] for r in rows]
    samples = run_dir / "samples"
    sample_bytes = sum(p.stat().st_size for p in samples.iterdir()) if samples.is_dir() else 0
    return {
        "steps": steps,
        "wall_s": wall_s,
        "step_s_median": statistics.median(step_s),
        "schedule_s_median": statistics.median(schedule_s),
        "schedule_frac_of_step": sum(schedule_s) / sum(step_s),
        "schedule_frac_max": max(a / b for a, b in zip(schedule_s, step_s, strict=True)),
        "schedule_file_bytes_per_step": (run_dir / "schedule.jsonl").stat().st_size / steps,
        "sample_bytes_per_step": sample_bytes / steps,
        "timing_s_step_total": sum(step_s),
    }


def curves(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    return {key: [(r["step"], r[key]) for r in records(run_dir) if key in r] for key in CURVES}


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVES), figsize=(3.6 * len(CURVES), 3.4))
    for name, data in results.items():
        for ax, key in zip(axes, CURVES, strict=True):
            points = data["curves"][key]
            if points:
                ax.plot(*zip(*points, strict=True), label=name, marker="." if key.startswith("eval") else None)
    for ax, key in zip(axes, CURVES, strict=True):
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("global step")
    axes[0].legend(fontsize=8)
    fig.suptitle(
        "the demo's async run's samples, re-trained under each correction (dppo replay --samples)", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="the demo's global steps (its default: 60)")
    parser.add_argument("--test-freq", type=int, default=5, help="held-out greedy evaluations every this many steps")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=Path("bench_out/replay"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    common = [f"trainer.total_steps={args.steps}", "trainer.progress_bar=false", f"trainer.test_freq={args.test_freq}"]
    out: dict = {"steps": args.steps}

    plain_dir, run_dir = args.out / "run_plain", args.out / "run"
    wall, _ = dppo("train", f"trainer.output_dir={plain_dir}", *common)
    out["cost_schedule_only"] = cost(plain_dir, wall)
    wall, _ = dppo("train", f"trainer.output_dir={run_dir}", "trainer.record_samples=true", *common)
    out["cost_with_samples"] = cost(run_dir, wall)
    print(json.dumps({k: out[k] for k in ("cost_schedule_only", "cost_with_samples")}, indent=1), flush=True)

    wall, stdout = dppo("replay", str(run_dir), "--out", str(args.out / "replay"))
    out["replay"] = {"wall_s": wall, "lines": [line.strip() for line in stdout.splitlines()[-3:]]}
    print(json.dumps(out["replay"], indent=1), flush=True)

    results = {"run (token-TIS, generated)": {"curves": curves(run_dir)}}
    for name in args.variants:
        target = args.out / f"samples_{name}"
        wall, stdout = dppo("replay", str(run_dir), "--samples", "--out", str(target), *VARIANTS[name])
        rows = records(target)
        results[name] = {
            "overrides": VARIANTS[name],
            "wall_s": wall,
            "lines": [line.strip() for line in stdout.splitlines()[-3:]],
            "final": {key: rows[-1].get(key) for key in ("eval/accuracy", "eval/reward", "actor/pg_clipfrac")},
            "curves": curves(target),
        }
        print(name, json.dumps(results[name]["final"]), f"{wall:.0f} s", flush=True)
    out["ab"] = results
    plot(results, args.out / "replay_ab.png")
    (args.out / "replay_bench.json").write_text(json.dumps(out, indent=1))
    print(f"written: {args.out / 'replay_bench.json'}, {args.out / 'replay_ab.png'}")


if __name__ == "__main__":
    main()
