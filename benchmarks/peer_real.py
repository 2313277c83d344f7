"""dppo against TRL's GRPOTrainer on `make real`'s work (issue 35, point 5): `make bench-peers-real`.

    .venv/bin/python benchmarks/peer_real.py [--seeds 0 1] [--steps 20] [--out bench_out/peers_real] [--only dppo|trl]

The work: SmolLM2-135M-Instruct (models/smollm2-135m-instruct, imported first if missing, not timed) on two-term
arithmetic, the problems, reward and settings of examples/real/smollm2_arithmetic.yaml. For each seed, alternating
which system goes first from seed to seed:

    dppo  `dppo train --config examples/real/smollm2_arithmetic.yaml` as `make real` runs it (its engine: vLLM from
          .venv-vllm once `make vllm` has run, else hf; actor.mixed_precision and rollout.dtype decided once at the
          start, as real_run decides them), trainer.seed=S, trainer.total_steps=--steps, no base measurement;
    TRL   benchmarks/trl_real.py in .venv-trl: GRPOTrainer with the settings that match (its docstring lists them and
          what is not matched), the same problems (written here with dppo's generator), the same reward, bf16
          compute where dppo's actor computes in it.

Each run is one process, timed from its start to its exit; each progress line (dppo's metrics.jsonl, trl_real.py's
line per generation cycle) is stamped when it appears. Both evaluate held-out greedy accuracy on the 256 problems
every 2 global steps and after the last. Per run: the seconds to the first evaluation at or above 0.5 (and 0.7), the
whole process, the final accuracy. The table gives each system's median over the seeds, the ratios dppo / TRL, and
PASS/FAIL against issue 35's targets: time to 0.5 <= 0.6x TRL's, whole process <= 1.0x, final accuracy no lower.
OUT gets peers_real.json (every run, the summary, the verdicts) and peers_real.png (both systems' curves).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_run  # next to this file

REPO = real_run.REPO
TRL_PYTHON = REPO / ".venv-trl" / "bin" / "python"
THRESHOLDS = (0.5, 0.7)
TARGETS = {"to_0.5_s": 0.6, "whole_s": 1.0}  # dppo's figure at most this multiple of TRL's
EVAL_EVERY = 2  # the YAML's trainer.test_freq


@dataclass
class Run:
    system: str
    seed: int
    points: list[tuple[int, float, float]] = field(default_factory=list)  # (global step, s from start, held-out acc)
    whole_s: float = 0.0
    final_acc: float | None = None
    steps: int = 0

    def time_to(self, threshold: float) -> float | None:
        return next((at for _, at, acc in self.points if acc >= threshold), None)

    def summary(self) -> dict:
        out = {f"to_{t}_s": self.time_to(t) for t in THRESHOLDS}
        out.update(
            whole_s=self.whole_s, final_acc=self.final_acc, best_acc=max((a for *_, a in self.points), default=None)
        )
        return out


# ---- pure parts ---------------------------------------------------------------------------------------------


def median(values: list[float | None]) -> float | None:
    """The median of values, None if any run never got there (a run that did not reach a threshold has no time)."""
    if not values or any(v is None for v in values):
        return None
    return statistics.median(values)


def verdicts(dppo: dict, trl: dict) -> dict[str, dict]:
    """dppo's medians against TRL's: each target's ratio and whether it is met; final accuracy no lower."""
    out = {}
    for key, limit in TARGETS.items():
        ours, theirs = dppo.get(key), trl.get(key)
        if ours is None or theirs is None:
            ratio, met = None, ours is not None and theirs is None
        else:
            ratio = ours / theirs
            met = ratio <= limit
        out[key] = {"dppo": ours, "trl": theirs, "ratio": ratio, "limit": limit, "met": met}
    ours, theirs = dppo.get("final_acc"), trl.get("final_acc")
    met = ours is not None and (theirs is None or ours >= theirs)
    out["final_acc"] = {"dppo": ours, "trl": theirs, "met": met}
    return out


def medians(runs: list[Run]) -> dict:
    summaries = [r.summary() for r in runs]
    return {key: median([s[key] for s in summaries]) for key in summaries[0]} if summaries else {}


# ---- running ---------------------------------------------------------------------------------------------


def write_task(path: Path, config: Path) -> dict:
    """The YAML's training and held-out problems as dppo's source draws them, for trl_real.py: JSON rows of prompt
    (question + suffix), answer and entry (score_answer's)."""
    from dppo.config import load_config
    from dppo.data.reasoning_gym import prompt_text, split_entries

    cfg = load_config([], config_file=config)
    rg = cfg.data.reasoning_gym
    train, val = split_entries(rg, cfg.trainer.seed)

    def rows(entries, config=None):
        """config: the settings the entries were generated with where they are not rg.config's (score_answer's
        extra_info then carries them, as dppo's source gives them)."""
        return [
            {
                "prompt": prompt_text(e["question"], rg.prompt_suffix),
                "answer": e["answer"],
                "entry": json.dumps(e if config is None else {"entry": json.dumps(e), "config": json.dumps(config)}),
            }
            for e in entries
        ]

    fixed = {  # trl_real.py's constants: the settings it matches
        "trainer.train_batch_size": (cfg.trainer.train_batch_size, 8),
        "rollout.n": (cfg.rollout.n, 8),
        "data.max_response_length": (cfg.data.max_response_length, 12),
    }
    for key, (ours, theirs) in fixed.items():
        if ours != theirs:
            raise SystemExit(f"peer_real: {config} sets {key}={ours}, but trl_real.py runs {theirs}: change both")
    task = {
        "dataset": rg.dataset,
        "config": dict(rg.config),
        "train": rows(train),
        "val": rows(val, None if rg.val_config is None else rg.held_out_config),
        # what trl_real.py takes from the run's config
        "lr": cfg.actor.lr,
        "steps_per_generation": cfg.trainer.parameter_sync_step,
    }
    path.write_text(json.dumps(task))
    return task


def run_dppo(seed: int, steps: int, out: Path, engine: str, python: Path, log, precision: list[str]) -> Run:
    """precision: actor.mixed_precision and rollout.dtype as main resolved them (real_run.precision_overrides)."""
    run_dir = out / f"dppo_seed{seed}"
    overrides = [
        f"model.path={real_run.MODEL_DIR}",
        *real_run.engine_overrides(engine),
        *precision,
        f"trainer.output_dir={run_dir}",
        f"trainer.seed={seed}",
        f"trainer.total_steps={steps}",
    ]
    start = time.perf_counter()
    stamped = real_run.train(python, real_run.CONFIG, overrides, run_dir, start, log)
    run = Run("dppo", seed, whole_s=time.perf_counter() - start)
    run.points = [(p.step, p.at_s, p.acc) for p in real_run.eval_points(stamped)]
    run.steps = int(stamped[-1][0]["step"]) if stamped else 0
    run.final_acc = json.loads((run_dir / "summary.json").read_text())["evaluation"].get(real_run.ACC_KEY)
    return run


def run_trl(seed: int, steps: int, out: Path, task_file: Path, task: dict, log, bf16: bool) -> Run:
    """bf16: TRL's bf16=True (autocast), where dppo's actor.mixed_precision resolved to bfloat16."""
    run_dir = out / f"trl_seed{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    progress, result = run_dir / "progress.jsonl", run_dir / "result.json"
    progress.unlink(missing_ok=True)
    cmd = [
        str(TRL_PYTHON),
        str(Path(__file__).resolve().parent / "trl_real.py"),
        "--model",
        str(real_run.MODEL_DIR),
        "--task",
        str(task_file),
        "--seed",
        str(seed),
        "--steps",
        str(steps),
        "--lr",
        str(task["lr"]),
        "--steps-per-generation",
        str(task["steps_per_generation"]),
        "--eval-every",
        str(EVAL_EVERY),
        "--progress",
        str(progress),
        "--result",
        str(result),
        "--output-dir",
        str(run_dir / "trainer"),
        "--bf16" if bf16 else "--no-bf16",
    ]
    print(f"TRL: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    run = Run("trl", seed)
    seen: list[dict] = []
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=real_run._env())

    def poll_once() -> None:
        for line in real_run._jsonl(progress)[len(seen) :]:
            at_s = time.perf_counter() - start
            seen.append(line)
            text = f"step {line['step']:>3}  {at_s:6.0f} s  reward {line['reward']:.3f}  sampled acc {line['acc']:.3f}"
            if "val_acc" in line:
                run.points.append((int(line["step"]), at_s, float(line["val_acc"])))
                text += f"  held-out greedy acc {line['val_acc']:.3f}"
            print("  TRL " + text, flush=True)

    real_run.follow(proc, poll_once, "trl_real.py", log)
    run.whole_s = time.perf_counter() - start
    run.steps = len(seen)
    run.final_acc = json.loads(result.read_text())["evaluation"]["acc"]
    return run


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = {"dppo": "tab:blue", "trl": "tab:orange"}
    for run in runs:
        xs = [at for _, at, _ in run.points]
        ys = [acc for *_, acc in run.points]
        style = "-" if run.seed == runs[0].seed else "--"
        ax.plot(xs, ys, style, marker=".", color=colors[run.system], label=f"{run.system}, seed {run.seed}")
    for t in THRESHOLDS:
        ax.axhline(t, color="grey", linewidth=0.6)
    ax.set_xlabel("seconds from the process start")
    ax.set_ylabel("held-out greedy accuracy (256 problems)")
    ax.set_title("SmolLM2-135M-Instruct, two-term arithmetic: dppo against TRL's GRPOTrainer")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(dppo: dict, trl: dict, verdict: dict) -> list[str]:
    def f(x, digits=1):
        return "n/a" if x is None else f"{x:.{digits}f}"

    lines = [f"  {'':<22}{'dppo':>10}{'TRL':>10}{'dppo/TRL':>10}  target"]
    for key in ("to_0.5_s", "to_0.7_s", "whole_s"):
        v = verdict.get(key)
        ratio = None if dppo.get(key) is None or trl.get(key) is None else dppo[key] / trl[key]
        target = "" if v is None else f"<= {v['limit']}x: {'PASS' if v['met'] else 'FAIL'}"
        lines.append(f"  {key:<22}{f(dppo.get(key)):>10}{f(trl.get(key)):>10}{f(ratio, 2):>10}  {target}")
    v = verdict["final_acc"]
    lines.append(
        f"  {'final_acc':<22}{f(dppo.get('final_acc'), 3):>10}{f(trl.get('final_acc'), 3):>10}{'':>10}  "
        f"no lower: {'PASS' if v['met'] else 'FAIL'}"
    )
    lines.append(f"  {'best_acc':<22}{f(dppo.get('best_acc'), 3):>10}{f(trl.get('best_acc'), 3):>10}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=20, help="global steps of each run (default %(default)s)")
    parser.add_argument("--out", default=str(REPO / "bench_out" / "peers_real"))
    parser.add_argument("--only", choices=["dppo", "trl"], help="run one system only")
    parser.add_argument("--engine", choices=["auto", "vllm", "hf"], default="auto", help="dppo's engine (real_run's)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: expected >= 1")
    if args.only != "dppo" and not TRL_PYTHON.exists():
        raise SystemExit("peer_real: .venv-trl is missing: run `make bench-peers-real` (it builds it)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    engine, python = real_run.pick_engine(args.engine)
    runs: list[Run] = []
    with open(out / "peers_real.log", "w") as log:
        real_run.import_model(real_run.MODEL_DIR, log)
        task_file = out / "task.json"
        task = write_task(task_file, real_run.CONFIG)
        print(f"{len(task['train'])} training and {len(task['val'])} held-out problems: {task_file}", flush=True)
        # decided once, for both systems: dppo's two keys, and TRL's bf16 as dppo's actor
        engine_keys = [f"model.path={real_run.MODEL_DIR}", *real_run.engine_overrides(engine)]
        precision, precision_line = real_run.precision_overrides(real_run.CONFIG, engine_keys)
        if precision_line is not None:
            print(precision_line, flush=True)
        bf16 = "actor.mixed_precision=bfloat16" in precision
        for i, seed in enumerate(args.seeds):
            order = ["dppo", "trl"] if i % 2 == 0 else ["trl", "dppo"]
            for system in order:
                if args.only and system != args.only:
                    continue
                print(f"--- seed {seed}: {system} ---", flush=True)
                if system == "dppo":
                    runs.append(run_dppo(seed, args.steps, out, engine, python, log, precision))
                else:
                    runs.append(run_trl(seed, args.steps, out, task_file, task, log, bf16))
                print(f"  {system} seed {seed}: {runs[-1].summary()}", flush=True)
    dppo = medians([r for r in runs if r.system == "dppo"])
    trl = medians([r for r in runs if r.system == "trl"])
    verdict = verdicts(dppo, trl) if dppo and trl else {}
    result = {
        "engine": engine,
        "precision": precision_line or " ".join(precision),
        "steps": args.steps,
        "seeds": args.seeds,
        "runs": [asdict(r) | {"summary": r.summary()} for r in runs],
        "medians": {"dppo": dppo, "trl": trl},
        "verdicts": verdict,
    }
    (out / "peers_real.json").write_text(json.dumps(result, indent=2))
    plot(runs, out / "peers_real.png")
    if verdict:
        print("\nmake bench-peers-real (medians over seeds " + " ".join(map(str, args.seeds)) + "):")
        print("\n".join(table(dppo, trl, verdict)))
    print(f"\n{out / 'peers_real.json'}, {out / 'peers_real.png'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
