"""Does every policy loss_mode and advantage estimator learn the demo task in a short sync run?

For each name, one `dppo train` run as a user starts it (a subprocess: `python -m dppo train`), on the demo's
defaults but synchronous and without Ray (trainer.mode=sync ray.enabled=false) for --steps optimizer steps;
the figures come from its summary.json: the mean reward of the first and the last 10% of steps, and the greedy
evaluation at the end. A name "learns" when the last 10% beat the first 10% by --min-gain.

    python benchmarks/loss_modes_learn.py                      # every loss_mode, then every estimator
    python benchmarks/loss_modes_learn.py --only gspo cispo    # some names (loss modes or estimators)

Prints a table and writes loss_modes_learn.json (in --out). About 50 s a run on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dppo.algo import ADVANTAGE_ESTIMATORS, LOSS_MODES

# Keys a loss needs that have no default (verl's neither): dro's beta.
LOSS_EXTRA = {"dro": ["actor.policy_loss.dro_beta=0.1"]}


def runs(only: list[str] | None) -> list[tuple[str, list[str]]]:
    """(name, overrides) of every run asked for."""
    out = [(f"loss_mode={m}", [f"actor.policy_loss.loss_mode={m}", *LOSS_EXTRA.get(m, [])]) for m in LOSS_MODES]
    out += [(f"adv_estimator={e}", [f"algorithm.adv_estimator={e}"]) for e in ADVANTAGE_ESTIMATORS]
    return [r for r in out if only is None or r[0].split("=", 1)[1] in only]


def run_one(overrides: list[str], steps: int, out_dir: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "dppo",
        "train",
        "trainer.mode=sync",
        "ray.enabled=false",
        f"trainer.total_steps={steps}",
        f"trainer.output_dir={out_dir}",
        "trainer.progress_bar=false",
        *overrides,
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)  # a failed run is reported, not raised
    wall_s = time.perf_counter() - start
    if proc.returncode != 0:
        return {
            "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}",
            "wall_s": wall_s,
        }
    summary = json.loads((out_dir / "summary.json").read_text())
    rows = summary["summary"]
    return {
        "first_10pct_reward": float(rows["reward, first 10% of steps"]),
        "last_10pct_reward": float(rows["reward, last 10% of steps"]),
        "greedy_eval_reward": summary["evaluation"]["eval/reward"],
        "wall_s": wall_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--min-gain", type=float, default=0.1)
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--out", type=Path, default=Path("benchmarks"))
    args = parser.parse_args()
    results = {}
    print(f"{'run':40s} {'first10%':>9s} {'last10%':>9s} {'eval':>7s} {'learns':>7s} {'wall_s':>7s}")
    for name, overrides in runs(args.only):
        with tempfile.TemporaryDirectory() as tmp:
            r = run_one(overrides, args.steps, Path(tmp) / "run")
        if "error" not in r:
            r["learns"] = r["last_10pct_reward"] - r["first_10pct_reward"] >= args.min_gain
            print(
                f"{name:40s} {r['first_10pct_reward']:9.3f} {r['last_10pct_reward']:9.3f} "
                f"{r['greedy_eval_reward']:7.3f} {r['learns']!s:>7} {r['wall_s']:7.1f}",
                flush=True,
            )
        else:
            print(f"{name:40s} error: {r['error']}", flush=True)
        results[name] = r
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "loss_modes_learn.json").write_text(json.dumps({"steps": args.steps, "results": results}, indent=1))


if __name__ == "__main__":
    main()
