"""What does each process of a real `dppo train` run hold at its peak, against the preflight's estimate, and where do
its steps go, fp32 against bf16 compute (actor.mixed_precision)? (issue 35, points 4 and 6)

    python benchmarks/real_run_bench.py --model-path DIR --train-files train.parquet --reward reward.py \
        [--steps 4] [--precisions null bfloat16] [--rounds 1] [--out bench_out/real_run.json] [key=value ...]

Runs `python -m dppo train` on the model and data given, with issue 35's settings (train_batch_size=8, rollout.n=8,
parameter_sync_step=2, actor.lr=1e-5, data.max_response_length=12; separate-async, hf engine, local rollout
processes: the defaults) and any key=value after them, once per actor.mixed_precision of --precisions, alternating
--rounds times (the machine is shared: the ratio of two runs next to each other is the figure that counts).

Per run, per process (memory_bench's sampler: every SAMPLE_S the smaps_rollup of each process of the tree): peak
PSS and RSS, and the kernel's own high-water mark of the RSS (VmHWM of /proc/PID/status, exact however short the
peak), beside the preflight's estimate of its role (dppo.launch.preflight.memory_estimate). Per step (from
metrics.jsonl, the first step left out as warm-up): the medians of the step and its parts (timing_s/*) and the
tokens/s of the update and of the old-log-prob passes: sequences x (prompt + response tokens) / seconds, with the
prompt tokens the mean over the data of its chat-templated prompts; the passes score the cycle's later mini-batches
once each (ahead at trigger 0, or from slot 0 at their trigger): (parameter_sync_step - 1) / parameter_sync_step of
a step's sequences, in timing_s/score_ahead + timing_s/old_log_prob. A printed table and a JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_bench import GIB, REPO, Sampler, estimate_for, read_kib, run_and_sample  # noqa: E402

PS = 2  # trainer.parameter_sync_step of issue 35's run
ISSUE_35 = [
    "trainer.train_batch_size=8",
    "rollout.n=8",
    f"trainer.parameter_sync_step={PS}",
    "actor.lr=1e-5",
    "data.max_response_length=12",
    "trainer.checkpoint_every=0",
    "trainer.progress_bar=false",
]
TIMES = ("step", "gen_wait", "old_log_prob", "score_ahead", "snapshot", "update_actor", "weight_sync")


@dataclass
class HighWaterSampler(Sampler):
    """memory_bench's Sampler, plus per process its VmHWM (the kernel's peak RSS) and its peak PSS without the shared
    memory it maps (Pss_Shmem: the published weights, which the shared-weights role counts)."""

    hwm_bytes: dict[int, int] = field(default_factory=dict)
    own_pss_bytes: dict[int, int] = field(default_factory=dict)

    def sample(self) -> None:
        super().sample()
        for pid in self.peaks:
            hwm = read_kib(f"/proc/{pid}/status", ("VmHWM",)).get("VmHWM")
            if hwm is not None:
                self.hwm_bytes[pid] = max(self.hwm_bytes.get(pid, 0), hwm * 1024)
            mem = read_kib(f"/proc/{pid}/smaps_rollup", ("Pss", "Pss_Shmem"))
            if "Pss" in mem:
                own = (mem["Pss"] - mem.get("Pss_Shmem", 0)) * 1024
                self.own_pss_bytes[pid] = max(self.own_pss_bytes.get(pid, 0), own)


def mean_prompt_tokens(model_path: str, train_files: str) -> float:
    """The mean length of the data's prompts after the chat template, in tokens."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    prompts = pq.read_table(train_files, columns=["prompt"]).column("prompt").to_pylist()[:256]
    return statistics.mean(
        len(tok.apply_chat_template(p, add_generation_prompt=True, return_dict=False)) for p in prompts
    )


def step_figures(run_dir: Path, sequences_per_step: int, prompt_tokens: float) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    steady = records[1:] or records
    out = {f"{k}_s": statistics.median(r.get(f"timing_s/{k}", 0.0) for r in steady) for k in TIMES}
    response = statistics.mean(r.get("response_length/mean", 0.0) for r in steady)
    tokens = sequences_per_step * (prompt_tokens + response)
    passes_s = out["old_log_prob_s"] + out["score_ahead_s"]
    out.update(
        steps=len(records),
        response_tokens_mean=response,
        tokens_per_step=tokens,
        update_tokens_per_s=tokens / out["update_actor_s"] if out["update_actor_s"] else None,
        old_log_prob_tokens_per_s=tokens * (PS - 1) / PS / passes_s if passes_s > 0.05 else None,
        step_s_all=[r.get("timing_s/step") for r in records],
        score_mean=[r.get("critic/score/mean") for r in records],
    )
    return out


def by_process(sampler: HighWaterSampler) -> list[dict]:
    return [
        {
            "pid": p.pid,
            "role": p.role,
            "title": p.title,
            "peak_pss_bytes": p.pss_bytes,
            "peak_rss_bytes": p.rss_bytes,
            "hwm_bytes": sampler.hwm_bytes.get(p.pid, 0),
            "peak_own_pss_bytes": sampler.own_pss_bytes.get(p.pid, 0),
        }
        for p in sorted(sampler.peaks.values(), key=lambda p: -p.pss_bytes)
        if p.pss_bytes > 64 * 2**20
    ]


def run_one(args, precision: str, work: Path, prompt_tokens: float) -> dict:
    run_dir = work / f"run-{precision}-{len(list(work.iterdir()))}"
    targs = [
        f"model.path={args.model_path}",
        f"data.train_files={args.train_files}",
        f"custom_reward_function.path={args.reward}",
        f"trainer.total_steps={args.steps}",
        f"trainer.output_dir={run_dir}",
        *ISSUE_35,
        *args.overrides,
    ]
    if precision != "unset":  # unset: a tree without the key (--repo of an older dppo)
        targs.append(f"actor.mixed_precision={precision}")
    env = {**os.environ, "PYTHONPATH": str(args.repo), "HF_HUB_OFFLINE": "1"}
    estimate = estimate_for(args.repo, targs, env)
    log = work / f"{run_dir.name}.log"
    result_sampler, code, wall_s = run_and_sample(
        [sys.executable, "-m", "dppo", "train", *targs], env, log, args.repo, HighWaterSampler
    )
    figures = step_figures(run_dir, 64, prompt_tokens) if code == 0 else {}
    return {
        "precision": precision,
        "exit_code": code,
        "wall_s": wall_s,
        "load": os.getloadavg(),
        "estimate": estimate,
        "processes": by_process(result_sampler),
        "peak_total_pss_bytes": result_sampler.peak_total_pss_bytes,
        "peak_shmem_bytes": result_sampler.peak_shmem_bytes,
        **figures,
        "log_tail": log.read_text()[-1200:],
    }


def print_run(r: dict) -> None:
    print(
        f"\nactor.mixed_precision={r['precision']}: exit {r['exit_code']}, {r['wall_s']:.0f} s, load {r['load'][0]:.2f}"
    )
    est = (r["estimate"] or {}).get("roles", {})
    print(
        f"  {'process':24s} {'PSS-shm':>9s} {'peak PSS':>9s} {'peak RSS':>9s} {'VmHWM':>9s} {'estimate':>9s} {'est/meas':>8s}"
        "   GiB (PSS-shm: peak PSS without the shared weights it maps)"
    )
    for p in r["processes"]:
        e = est.get(p["role"])
        ratio = f"{e / p['peak_own_pss_bytes']:8.2f}" if e and p["peak_own_pss_bytes"] else ""
        print(
            f"  {p['role'] + ' ' + str(p['pid']):24s} {p['peak_own_pss_bytes'] / GIB:9.2f} {p['peak_pss_bytes'] / GIB:9.2f} "
            f"{p['peak_rss_bytes'] / GIB:9.2f} {p['hwm_bytes'] / GIB:9.2f} {'' if e is None else f'{e / GIB:9.2f}'} {ratio}"
        )
    if est.get("shared_weights"):
        print(
            f"  {'shared weights (Shmem)':24s} {r['peak_shmem_bytes'] / GIB:9.2f} {'':9s} {'':9s} {'':9s} "
            f"{est['shared_weights'] / GIB:9.2f}"
        )
    if r["exit_code"] == 0:
        parts = ", ".join(f"{k} {r[f'{k}_s']:.2f}" for k in TIMES)
        print(f"  median s ({r['steps'] - 1} steps after the first): {parts}")
        print(
            f"  tokens/s: update {r['update_tokens_per_s']:.0f}, old-log-prob passes "
            f"{r['old_log_prob_tokens_per_s'] or float('nan'):.0f} ({r['tokens_per_step']:.0f} tokens a step)"
        )
    else:
        print(r["log_tail"])


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--train-files", required=True)
    parser.add_argument("--reward", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--precisions",
        nargs="+",
        default=["null", "bfloat16"],
        help="actor.mixed_precision of each run; unset: the key is not passed (a tree without it)",
    )
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--repo", type=Path, default=REPO)
    parser.add_argument("--out", type=Path, default=REPO / "bench_out" / "real_run.json")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the run")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="dppo-real-run."))
    prompt_tokens = mean_prompt_tokens(args.model_path, args.train_files)
    runs = []
    for i in range(args.rounds):
        order = args.precisions if i % 2 == 0 else list(reversed(args.precisions))
        for precision in order:
            runs.append(run_one(args, precision, work, prompt_tokens))
            print_run(runs[-1])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"prompt_tokens_mean": prompt_tokens, "runs": runs}, indent=1))
    print(f"json: {args.out}; runs under {work}")
    return runs


if __name__ == "__main__":
    main()
