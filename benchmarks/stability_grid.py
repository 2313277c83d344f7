"""Which remedy makes the demo end where it peaked, at parameter_sync_step 4 and 8, and what does it cost in time to
0.9? (issue 32): `make bench-stability`.

    .venv/bin/python benchmarks/stability_grid.py [--seeds 0 1] [--settings baseline kl_guard] [--sync-steps 4]
                                                  [--work bench_out/stability] [--out bench_out/stability.json]

The demo (`dppo train` with its defaults, no Ray) sometimes collapses after it peaked: late in the run nearly every
group has one reward, so no advantage, and Adam still takes steps of about lr in whatever direction the noise points.
This runs it over seeds (default 0-19) at trainer.parameter_sync_step 4 and 8, once per SETTINGS entry: the defaults,
each remedy alone, and the combination expected to win. Each run is a subprocess of `dppo train`, timed from its start
(benchmarks/peer_bench.py's measure: the stamp of each metrics line as it appears), and read back from its
summary.json and metrics.jsonl:

    exact       the final greedy evaluation's exact match (eval/accuracy)
    last 10%    the mean sampled reward (critic/score/mean) over the last 10% of the steps (dppo.trainer.report)
    to 0.9      wall seconds from the process start to the first step whose critic/score/mean is >= 0.9
                (peer_bench's moving_mean_crossing with a window of one step), and that step's number (which
                does not depend on how busy the machine was)

The table gives, per setting and parameter_sync_step: the seeds that end at exact match >= 0.99, the min and median
exact match, the median last-10% reward, the median time to 0.9 and its ratio to the baseline's at
parameter_sync_step 4, and the median step at which 0.9 was reached. Every run keeps its result in --work/<setting>/ps<k>/seed<s>/result.json; a run whose result is
there is not run again (the grid resumes where it stopped); its checkpoints and hf_model/ are deleted once read.
--out writes every run and the table as JSON. The whole grid is 240 runs of about 30 s on a quiet 2-core machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SYNC_STEPS = (4, 8)
SEEDS = tuple(range(20))
TARGET_EXACT = 0.99
# The settings, each a list of `dppo train` overrides on top of the defaults.
LR_SCHEDULE = [
    "actor.optim.lr_warmup_steps_ratio=0.05",
    "actor.optim.lr_scheduler_type=cosine",
    "actor.optim.min_lr_ratio=0.1",
]
KL_GUARD = ["actor.max_ppo_kl=0.1"]
# dppo's defaults before 2026-12-03 (verl's): a constant lr from the first step. The lr schedule won the grid and became
# the default; the baseline and each remedy alone keep the constant lr they were measured against.
CONSTANT_LR = [
    "actor.optim.lr_scheduler_type=constant",
    "actor.optim.lr_warmup_steps_ratio=0",
    "actor.optim.min_lr_ratio=0",
]
SETTINGS = {
    "baseline": CONSTANT_LR,
    # at most 2 mini-batches' worth of groups a trigger: without a limit the last steps, where nearly every group
    # has one reward, take minutes each on this machine
    "filter_groups": [
        *CONSTANT_LR,
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.max_num_gen_batches=2",
    ],
    # a 5% warmup from 0, then a cosine down to 0.1 x lr at the last step: dppo's defaults since 2026-12-03
    "lr_schedule": LR_SCHEDULE,
    "kl_guard": [*CONSTANT_LR, *KL_GUARD],
    "dr_grpo": [*CONSTANT_LR, "algorithm.norm_adv_by_std_in_grpo=false"],
    "schedule_and_guard": [*LR_SCHEDULE, *KL_GUARD],  # the defaults and the guard
}


def peer_bench():
    """benchmarks/peer_bench.py as a module (its measure and moving_mean_crossing), loaded once from its path."""
    if "peer_bench" not in sys.modules:
        spec = importlib.util.spec_from_file_location("peer_bench", REPO / "benchmarks" / "peer_bench.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["peer_bench"] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules["peer_bench"]


# ---- pure parts (tests/unit/benchmarks/test_stability_grid.py) ------------------------------------------------------


def run_dir(work: Path, setting: str, sync_steps: int, seed: int) -> Path:
    return work / setting / f"ps{sync_steps}" / f"seed{seed}"


def overrides(setting: str, sync_steps: int, seed: int, out: Path) -> list[str]:
    """`dppo train`'s key=value arguments of one run: the demo's defaults without Ray, and the setting's keys."""
    return [
        f"trainer.seed={seed}",
        f"trainer.parameter_sync_step={sync_steps}",
        f"trainer.output_dir={out}",
        "ray.enabled=false",
        "trainer.progress_bar=false",
        *SETTINGS[setting],
    ]


def result_of(
    setting: str,
    sync_steps: int,
    seed: int,
    summary: dict,
    records: list[dict],
    stamps: list[tuple[int, float, float]],
    returncode: int,
    wall_s: float,
) -> dict:
    """One run's figures from its summary.json, its metrics.jsonl records and the stamps (step, reward, seconds since
    the process started) of its metrics lines."""
    from dppo.trainer.report import tail_mean

    evaluation = summary.get("evaluation", {})
    return {
        "setting": setting,
        "sync_steps": sync_steps,
        "seed": seed,
        "returncode": returncode,
        "wall_s": wall_s,
        "exact": evaluation.get("eval/accuracy"),
        "eval_reward": evaluation.get("eval/reward"),
        "last_10pct_reward": tail_mean(records, "critic/score/mean") if records else None,
        "to_0.9_s": peer_bench().moving_mean_crossing(stamps, 0.9, window=1),
        "step_0.9": next((r["step"] for r in records if r["critic/score/mean"] >= 0.9), None),
        "steps": len(records),
    }


def _median(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def table_rows(results: list[dict]) -> list[dict]:
    """Per (setting, sync_steps), in SETTINGS order: runs, seeds at exact >= TARGET_EXACT, min and median exact, the
    median last-10% reward, the median time to 0.9 (None if no run got there) and its ratio to the baseline's at
    parameter_sync_step 4 (None without that baseline), and the median step at which 0.9 was reached."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in results:
        groups.setdefault((r["setting"], r["sync_steps"]), []).append(r)
    base = groups.get(("baseline", 4))
    base_time = _median([r["to_0.9_s"] for r in base]) if base else None
    order = {name: i for i, name in enumerate(SETTINGS)}
    rows = []
    for (setting, ps), runs in sorted(groups.items(), key=lambda kv: (order.get(kv[0][0], len(order)), kv[0])):
        exact = [r["exact"] for r in runs]
        to_09 = _median([r["to_0.9_s"] for r in runs])
        rows.append(
            {
                "setting": setting,
                "sync_steps": ps,
                "runs": len(runs),
                "at_target": sum(e is not None and e >= TARGET_EXACT for e in exact),
                "min_exact": min((e for e in exact if e is not None), default=None),
                "median_exact": _median(exact),
                "median_last_10pct": _median([r["last_10pct_reward"] for r in runs]),
                "median_to_0.9_s": to_09,
                "to_0.9_ratio": to_09 / base_time if to_09 is not None and base_time else None,
                "median_step_0.9": _median([r.get("step_0.9") for r in runs]),
            }
        )
    return rows


def format_table(rows: list[dict]) -> str:
    def f(value, digits=3):
        return "n/a" if value is None else f"{value:.{digits}f}"

    lines = [
        f"| setting | ps | seeds at exact >= {TARGET_EXACT} | min / median exact | median last-10% reward | "
        "median s to 0.9 | vs baseline ps 4 | median step to 0.9 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "n/a" if r["to_0.9_ratio"] is None else f"{r['to_0.9_ratio']:.2f}x"
        lines.append(
            f"| {r['setting']} | {r['sync_steps']} | {r['at_target']} / {r['runs']} | {f(r['min_exact'])} / "
            f"{f(r['median_exact'])} | {f(r['median_last_10pct'])} | {f(r['median_to_0.9_s'], 1)} | {ratio} | "
            f"{f(r['median_step_0.9'], 1)} |"
        )
    return "\n".join(lines)


# ---- running -------------------------------------------------------------------------------------------------------


def run_one(setting: str, sync_steps: int, seed: int, work: Path, python: Path) -> dict:
    """One run, or its result from an earlier invocation (result.json in its directory)."""
    out = run_dir(work, setting, sync_steps, seed)
    done = out / "result.json"
    if done.exists():
        return json.loads(done.read_text())
    if out.exists():
        shutil.rmtree(out)  # a run stopped half way: start it afresh
    out.mkdir(parents=True)
    bench = peer_bench()
    cmd = [*bench.dppo_command(python), *overrides(setting, sync_steps, seed, out / "run")]
    run = bench.measure(
        bench.Run("dppo", seed, log=str(out / "log.txt")),
        cmd,
        {**os.environ, "HF_HUB_OFFLINE": "1"},
        out / "run" / "metrics.jsonl",
        bench.dppo_steps,
    )
    try:
        summary = json.loads((out / "run" / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        summary = {}
    from dppo.trainer.report import read_metrics

    records = read_metrics(out / "run" / "metrics.jsonl") if (out / "run" / "metrics.jsonl").exists() else []
    result = result_of(setting, sync_steps, seed, summary, records, run.steps, run.returncode, run.whole_s)
    for heavy in ("checkpoints", "hf_model"):
        shutil.rmtree(out / "run" / heavy, ignore_errors=True)
    if run.returncode == 0:  # a failed run is run again next time
        done.write_text(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument(
        "--settings",
        nargs="+",
        default=list(SETTINGS),
        choices=list(SETTINGS),
        metavar="SETTING",
        help=f"some of: {', '.join(SETTINGS)}",
    )
    parser.add_argument("--sync-steps", type=int, nargs="+", default=list(SYNC_STEPS))
    parser.add_argument("--work", default=str(REPO / "bench_out" / "stability"), help="where each run's outputs go")
    parser.add_argument("--out", default=None, help="JSON file of every run and the table")
    parser.add_argument("--python", default=sys.executable, help="the interpreter whose `dppo` runs")
    args = parser.parse_args(argv)
    work, started = Path(args.work), time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    results = []
    # seed by seed, the settings in turn: a machine that gets busier for a while slows every setting alike
    for ps in args.sync_steps:
        for seed in args.seeds:
            for setting in args.settings:
                r = run_one(setting, ps, seed, work, Path(args.python))
                results.append(r)
                print(
                    f"{setting} ps {ps} seed {seed}: rc {r['returncode']}, exact {r['exact']}, last 10% "
                    f"{r['last_10pct_reward']}, to 0.9 {r['to_0.9_s']} s, whole {r['wall_s']:.1f} s",
                    flush=True,
                )
    rows = table_rows(results)
    print(f"\nseeds {args.seeds} ({started}; load average now {os.getloadavg()[0]:.2f}):\n")
    print(format_table(rows))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps(
                {"started": started, "argv": sys.argv[1:], "settings": SETTINGS, "runs": results, "table": rows},
                indent=2,
            )
        )
    return 1 if any(r["returncode"] != 0 for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
