"""Does the FSDP2 actor train as the plain one on this machine's devices, at world size 1 and N, with exact old log-probs?

Runs dppo's trainer (sync mode, parameter_sync_step 4, trainer.verify_old_log_prob=true, fp32 so that the
old-log-prob check is stated in fp32) for --steps global steps, three ways:

    plain     world size 1, the plain module (actor.fsdp=auto), the rank in this process
    fsdp-1    world size 1, FSDP2 over a process group of one (actor.fsdp=always), the rank in this process
    fsdp-N    world size N = --world-size (default: the GPU count; skipped when 1): Ray actors, NCCL on GPUs

All three sample their first cycle from the same initial weights with the same seeds, so their first cycles see
the same groups. PASS/FAIL lines: every run's debug/old_log_prob_max_abs_diff <= 1e-6 (0.0 on the CPU); the
first cycle's grad norm of fsdp-1 and fsdp-N within 1e-4 relative of plain's. Prints each run's median cycle
time, the verification included (it gathers the whole model once a cycle and scores every batch twice, so these
times are not the actor's cost: cycle_bench.py --world-size measures that); writes JSON (--out).
benchmarks/gpu_check.sh runs it on a GPU machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from dppo.config import load_config
from dppo.trainer.ppo import PPOTrainer


def overrides(out_dir: str, device: str, steps: int, **extra) -> list[str]:
    values = {
        "trainer.output_dir": out_dir, "trainer.device": device, "trainer.total_steps": steps,
        "trainer.mode": "sync", "trainer.parameter_sync_step": 4, "trainer.train_batch_size": 16,
        "trainer.verify_old_log_prob": True, "trainer.eval_prompts": 0, "trainer.checkpoint_every": 0,
        "trainer.progress_bar": False, "rollout.n": 4, "task.length": 4, "model.hidden_size": 256,
        "model.num_hidden_layers": 4, "model.num_attention_heads": 4, "model.intermediate_size": 1024,
        "actor.micro_batch_size": 16, "actor.lr": 1e-3, **extra,
    }  # fmt: skip
    return [f"{k}={v}" for k, v in values.items()]


def run(name: str, args, **extra) -> dict:
    with tempfile.TemporaryDirectory() as out_dir:
        started = time.perf_counter()
        trainer = PPOTrainer(load_config(overrides(out_dir, args.device, args.steps, **extra)))
        built_s = time.perf_counter() - started
        records = trainer.fit().records
    row = {
        "run": name,
        "world_size": trainer.actor_group.world_size,
        "sharded": trainer.actor_group.sharded,
        "built_s": built_s,
        "cycle_s": statistics.median(r["timing_s/step"] for r in records),
        "first_grad_norm": records[0]["actor/grad_norm"],
        "old_log_prob_max_abs_diff": max(r["debug/old_log_prob_max_abs_diff"] for r in records),
    }
    print(
        f"{name:>8}: world size {row['world_size']}, {'FSDP2' if row['sharded'] else 'plain'}, cycle "
        f"{row['cycle_s']:.3f} s with the verification (built in {built_s:.1f} s), first grad norm {row['first_grad_norm']:.6g}, "
        f"old-log-prob max |diff| {row['old_log_prob_max_abs_diff']:.2e}",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--world-size", type=int, default=None, help="ranks of the fsdp-N run (default: GPU count)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench_out/fsdp_cycle.json"))
    args = parser.parse_args(argv)
    world_size = args.world_size or (torch.cuda.device_count() if args.device == "cuda" else 2)
    rows = [
        run("plain", args, **{"ray.enabled": False}),
        run("fsdp-1", args, **{"ray.enabled": False, "actor.fsdp": "always"}),
    ]
    if world_size > 1:
        import ray

        ray.init(address="local", include_dashboard=False, logging_level="WARNING")
        try:
            rows.append(run(f"fsdp-{world_size}", args, **{"trainer.n_gpus_per_node": world_size}))
        finally:
            ray.shutdown()
    plain = rows[0]
    limit = 0.0 if args.device == "cpu" else 1e-6
    goals = [
        (
            f"{r['run']}: old-log-prob max |diff| {r['old_log_prob_max_abs_diff']:.2e} (required <= {limit:g})",
            r["old_log_prob_max_abs_diff"] <= limit,
        )
        for r in rows
    ]
    for r in rows[1:]:
        rel = abs(r["first_grad_norm"] - plain["first_grad_norm"]) / plain["first_grad_norm"]
        goals.append(
            (
                f"{r['run']}: first cycle's grad norm {rel:.1e} relative off the plain module's (required "
                f"<= 1e-4); cycle {r['cycle_s'] / plain['cycle_s']:.2f}x the plain module's",
                rel <= 1e-4,
            )
        )
    for line, ok in goals:
        print(f"{'PASS' if ok else 'FAIL'}  {line}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "device": args.device,
                "rows": rows,
                "targets": [{"line": line, "pass": ok} for line, ok in goals],
            },
            indent=1,
        )
    )
    return 0 if all(ok for _, ok in goals) else 1


if __name__ == "__main__":
    raise SystemExit(main())
