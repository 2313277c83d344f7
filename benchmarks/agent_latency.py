"""Where does separate-async Decoupled PPO pay on an agent task? make agent's task at several tool latencies, async
against sync, in one run.

    .venv/bin/python benchmarks/agent_latency.py [--latencies-ms 0 50 200 1000] [--steps 16] [--out DIR] [key=value ...]

For each latency (milliseconds added to each calculator call: simulated remote-tool time, the agent's TOOL_LATENCY_S)
and each mode (trainer.mode=sync, then separate_async, the same seed and problems), `dppo train` on
examples/agent/smollm2_calculator.yaml for --steps global steps, the agent evaluated greedily on --val-size held-out
problems every --test-freq steps (through the trainer's evaluation engine, on the clock, in both modes alike). Per
latency: each mode's time from the process's start to the target accuracy, and async / sync.

The target: --target, or by default the sync run's final held-out accuracy at that latency ("async reaches sync's
final accuracy in what fraction of sync's time"; issue 44's targets: <= 0.8x at 0 ms, <= 0.5x at 200 ms). A run that
never reaches it counts as not reaching it (no ratio). The engine: vLLM once `make vllm` has run, else hf (as make
agent). Prints a table and writes OUT/agent_latency.json; every run's directory is kept under OUT.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import real_run  # noqa: E402  benchmarks/real_run.py: the model import, the engine, dppo train followed by its metrics

TASK = real_run.AGENT
LATENCY_KEY = "TOOL_LATENCY_S = 0.0"  # the line of examples/agent/calculator_agent.py that a latency replaces
MODES = ("sync", "separate_async")
TARGETS = {0: 0.8, 200: 0.5}  # issue 44: async's time to sync's final accuracy over sync's, at these latencies (ms)


def agent_with_latency(out: Path, latency_ms: float) -> Path:
    """A copy of make agent's agent whose calculator answers after latency_ms."""
    source = (real_run.REPO / "examples" / "agent" / "calculator_agent.py").read_text()
    if LATENCY_KEY not in source:
        raise SystemExit(f"agent_latency: examples/agent/calculator_agent.py has no line {LATENCY_KEY!r} to set")
    path = out / f"agent_{latency_ms:g}ms.py"
    path.write_text(source.replace(LATENCY_KEY, f"TOOL_LATENCY_S = {latency_ms / 1000.0!r}"))
    return path


def time_to_target(points: list[real_run.EvalPoint], target: float) -> tuple[float | None, int | None]:
    return real_run.time_to(points, target), real_run.step_to(points, target)


def summarize(runs: dict, target: float | None) -> dict:
    """Per latency: each mode's final accuracy, time and step to the target (sync's final unless target is given),
    and async / sync."""
    out = {}
    for latency, by_mode in runs.items():
        sync_points = by_mode["sync"]["points"]
        goal = target if target is not None else (sync_points[-1].acc if sync_points else None)
        row = {"target": goal}
        for mode, run in by_mode.items():
            at_s, step = (None, None) if goal is None else time_to_target(run["points"], goal)
            row[mode] = {"final": run["points"][-1].acc if run["points"] else None, "to_target_s": at_s, "step": step}
            row[mode]["wall_s"] = run["wall_s"]
        a, s = row["separate_async"]["to_target_s"], row["sync"]["to_target_s"]
        row["ratio"] = a / s if a is not None and s else None
        out[latency] = row
    return out


def table(summary: dict) -> list[str]:
    lines = [
        "| tool latency | target acc | sync: s to target (step) | async: s to target (step) | async / sync | goal |",
        "|---|---|---|---|---|---|",
    ]

    def cell(m: dict) -> str:
        return "not reached" if m["to_target_s"] is None else f"{m['to_target_s']:.0f} ({m['step']})"

    for latency, row in summary.items():
        ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        goal = TARGETS.get(int(latency))
        verdict = (
            ""
            if goal is None
            else f"<= {goal}x: {'met' if row['ratio'] is not None and row['ratio'] <= goal else 'NOT met'}"
        )
        target = "n/a" if row["target"] is None else f"{row['target']:.3f}"
        lines.append(
            f"| {latency} ms | {target} | {cell(row['sync'])} | {cell(row['separate_async'])} | {ratio} | {verdict} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latencies-ms", type=float, nargs="+", default=[0.0, 50.0, 200.0, 1000.0])
    parser.add_argument("--steps", type=int, default=16, help="global steps of each run")
    parser.add_argument("--test-freq", type=int, default=2)
    parser.add_argument("--val-size", type=int, default=128, help="held-out problems of each evaluation")
    parser.add_argument("--target", type=float, help="the accuracy to time (default: sync's final, per latency)")
    parser.add_argument("--engine", choices=["auto", "vllm", "hf"], default="auto")
    parser.add_argument("--out", default=str(real_run.REPO / "outputs" / "agent_latency"))
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every run")
    args = parser.parse_intermixed_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    engine, python = real_run.pick_engine(args.engine)
    common = [
        f"model.path={real_run.MODEL_DIR}",
        *real_run.engine_overrides(engine),
        f"trainer.total_steps={args.steps}",
        f"trainer.test_freq={args.test_freq}",
        f"data.reasoning_gym.val_size={args.val_size}",
        *args.overrides,
    ]
    runs: dict[str, dict] = {}
    with open(out / "agent_latency.log", "w") as log:
        real_run.import_model(real_run.MODEL_DIR, log)
        precision, line = real_run.precision_overrides(TASK.config, common)
        common += precision
        if line:
            print(line, flush=True)
        for latency in args.latencies_ms:
            agent = agent_with_latency(out, latency)
            runs[f"{latency:g}"] = {}
            for mode in MODES:
                run_dir = out / f"{latency:g}ms_{mode}"
                overrides = [
                    *common,
                    f"rollout.agent.path={agent}",
                    f"trainer.mode={mode}",
                    f"trainer.output_dir={run_dir}",
                ]
                print(f"\n== tool latency {latency:g} ms, {mode}", flush=True)
                clock = time.perf_counter()
                stamped = real_run.train(python, TASK.config, overrides, run_dir, clock, log, task=TASK)
                runs[f"{latency:g}"][mode] = {
                    "points": real_run.eval_points(stamped, TASK.acc_key),
                    "wall_s": time.perf_counter() - clock,
                }
    summary = summarize(runs, args.target)
    print("\n" + "\n".join(table(summary)), flush=True)
    serial = {
        latency: {mode: {**run, "points": [vars(p) for p in run["points"]]} for mode, run in by_mode.items()}
        for latency, by_mode in runs.items()
    }
    (out / "agent_latency.json").write_text(
        json.dumps({"argv": sys.argv[1:], "engine": engine, "runs": serial, "summary": summary}, indent=2)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
