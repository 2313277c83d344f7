"""How much host memory does each process of a `dppo train` run hold, per role, against what the model needs?

    python benchmarks/memory_bench.py --shape qwen2.5-0.5b --dtype float32 [--world-size 1] [--steps 3]
        [--repo PATH] [--malloc-tuning 0|1] [--out bench_out/memory.json]

Builds a model of --shape (random weights, saved with save_pretrained into a temporary directory; tied embeddings
as the real model has), then runs `python -m dppo train` on it in sync mode with the demo task: 4 prompts x 2
samples x 16 tokens a step, one optimizer step a step, --steps steps, no checkpoints and no eval. --repo runs
another tree's dppo (e.g. /work/main for the figures before a change).

Every SAMPLE_S it reads /proc/PID/smaps_rollup of every process descended from the run (the driver, Ray's GCS,
raylet and its helpers, each actor rank, each rollout worker, the replay buffer: Ray's actor processes are
found by their `ray::ClassName` proc titles) and the machine's Shmem (/proc/meminfo, whose growth over the run is
Ray's object store in use). Per role: peak RSS and peak PSS; and the peak over time of the PSS summed over the
whole tree (shared pages, the object store's included, counted once): the figure that must fit the machine.

Beside them, what the model's shape says each role must hold, counted exactly from its parameters
(dppo.launch.preflight.memory_estimate, the estimate `dppo train` prints), and the principled figure of
issue 23: weights + gradients + AdamW's two moments (4+4+8 = 16 B/param in fp32), + one snapshot slot + the
rollout's copy. Bytes per parameter of each. A printed table and a JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SAMPLE_S = 0.5
GIB = 2**30

# Qwen2-style shapes: (hidden, layers, heads, kv heads, intermediate, vocab, tied)
SHAPES = {
    "qwen2.5-0.5b": (896, 24, 14, 2, 4864, 151936, True),  # Qwen2.5-0.5B exactly: 494M parameters
    "small": (896, 2, 14, 2, 4864, 151936, True),  # the same vocab and widths, 2 layers: 160M, embedding-dominated
    "tiny": (64, 2, 4, 2, 128, 151936, True),  # 9.7M, nearly all embedding: seconds a step
}

ROLES = ("driver", "actor_rank", "rollout_worker", "replay_buffer", "ray_runtime")


def build_model_dir(shape: str, out_dir: Path) -> int:
    """A random-weight Qwen2 of `shape` saved to out_dir (config, safetensors); its parameter count (tied once)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, layers, heads, kv_heads, inter, vocab, tied = SHAPES[shape]
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=tied,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once


def train_args(model_dir: Path, out_dir: Path, dtype: str, world_size: int, steps: int) -> list[str]:
    return [
        f"model.path={model_dir}", f"model.dtype={dtype}", f"trainer.output_dir={out_dir}",
        "trainer.mode=sync", f"trainer.total_steps={steps}", "trainer.parameter_sync_step=1",
        "trainer.train_batch_size=4", "rollout.groups_per_batch=4", "rollout.n=2", "rollout.max_new_tokens=16",
        "actor.micro_batch_size=8", "trainer.checkpoint_every=0", "trainer.eval_prompts=0",
        "trainer.progress_bar=false", f"trainer.n_gpus_per_node={world_size}", "trainer.device=cpu",
    ]  # fmt: skip


# ---- sampling /proc ---------------------------------------------------------------------------------------


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    return children


def descendants(root: int) -> list[int]:
    children, out, todo = _children_map(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def role_of(cmdline: str, is_root: bool, comm: str = "") -> str:
    """The role of a process of the run, by its command line (Ray sets an actor's proc title to ray::Class...) or its
    name (comm: a local rollout worker of a run without Ray names itself dppo-rollout-N)."""
    if is_root:
        return "driver"
    if comm.startswith("dppo-rollout"):
        return "rollout_worker"
    if "ray::ActorRank" in cmdline:
        return "actor_rank"
    if "ray::RolloutWorkerActor" in cmdline:
        return "rollout_worker"
    if "ray::ReplayBufferActor" in cmdline:
        return "replay_buffer"
    return "ray_runtime"  # gcs_server, raylet (the object store lives in it), dashboard, idle workers


def read_kib(path: str, keys: tuple[str, ...]) -> dict[str, int]:
    out = {}
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in keys:
                    out[name] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return out


@dataclass
class ProcessPeak:
    pid: int
    role: str
    title: str
    rss_bytes: int = 0
    pss_bytes: int = 0


@dataclass
class Sampler:
    root: int
    peaks: dict[int, ProcessPeak] = field(default_factory=dict)
    peak_total_pss_bytes: int = 0
    peak_total_by_role: dict[str, int] = field(default_factory=dict)  # each role's PSS at the summed peak
    peak_shmem_bytes: int = 0
    shmem_start_bytes: int = 0

    def sample(self) -> None:
        total, by_role = 0, dict.fromkeys(ROLES, 0)
        for pid in descendants(self.root):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            mem = read_kib(f"/proc/{pid}/smaps_rollup", ("Rss", "Pss"))
            if "Pss" not in mem:
                continue
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                comm = ""
            role = role_of(cmdline, pid == self.root, comm)
            peak = self.peaks.setdefault(pid, ProcessPeak(pid, role, cmdline.strip()[:60]))
            if peak.role != role:  # an idle Ray worker that has become an actor since (its proc title changed)
                peak.role, peak.title = role, cmdline.strip()[:60]
            peak.rss_bytes = max(peak.rss_bytes, mem["Rss"] * 1024)
            peak.pss_bytes = max(peak.pss_bytes, mem["Pss"] * 1024)
            total += mem["Pss"] * 1024
            by_role[role] += mem["Pss"] * 1024
        if total > self.peak_total_pss_bytes:
            self.peak_total_pss_bytes, self.peak_total_by_role = total, by_role
        shmem = read_kib("/proc/meminfo", ("Shmem",)).get("Shmem", 0) * 1024
        self.peak_shmem_bytes = max(self.peak_shmem_bytes, shmem - self.shmem_start_bytes)


def run_and_sample(
    cmd: list[str], env: dict, log_path: Path, cwd: Path, sampler_cls: type[Sampler] = Sampler
) -> tuple[Sampler, int, float]:
    shmem_start = read_kib("/proc/meminfo", ("Shmem",)).get("Shmem", 0) * 1024
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd
        )  # cwd: `-m` puts it first on sys.path
    sampler = sampler_cls(proc.pid, shmem_start_bytes=shmem_start)
    done = threading.Event()

    def loop():
        while not done.is_set():
            sampler.sample()
            done.wait(SAMPLE_S)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    code = proc.wait()
    done.set()
    thread.join()
    return sampler, code, time.perf_counter() - start


# ---- the report ---------------------------------------------------------------------------------------------


def principled_bytes(params: int, dtype_bytes: int) -> int:
    """Issue 23's figure: weights + grads + AdamW's two moments (fp32 state for fp32 weights; the moments take the
    weights' dtype), + one snapshot slot + the rollout's copy."""
    return params * dtype_bytes * (1 + 1 + 2 + 1 + 1)


def step_times(out_dir: Path) -> list[float]:
    path = out_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line).get("timing_s/step", float("nan")) for line in path.read_text().splitlines() if line]


def summarize(sampler: Sampler, params: int, dtype_bytes: int, estimate: dict | None) -> dict:
    roles = {}
    for role in ROLES:
        procs = [p for p in sampler.peaks.values() if p.role == role]
        if procs:
            roles[role] = {
                "processes": len(procs),
                "peak_rss_bytes": max(p.rss_bytes for p in procs),
                "peak_pss_bytes": max(p.pss_bytes for p in procs),
                "pss_at_total_peak_bytes": sampler.peak_total_by_role.get(role, 0),
            }
    principled = principled_bytes(params, dtype_bytes)
    return {
        "params": params,
        "roles": roles,
        "peak_total_pss_bytes": sampler.peak_total_pss_bytes,
        "peak_object_store_bytes": sampler.peak_shmem_bytes,
        "principled_bytes": principled,
        "pss_over_principled": sampler.peak_total_pss_bytes / principled,
        "pss_bytes_per_param": sampler.peak_total_pss_bytes / params,
        "estimate": estimate,
        "processes": [asdict(p) for p in sorted(sampler.peaks.values(), key=lambda p: -p.pss_bytes)[:12]],
    }


def print_table(result: dict) -> None:
    params = result["params"]
    print(
        f"\n{result['label']}: {params / 1e6:.0f}M parameters; exit {result['exit_code']}; {result['wall_s']:.0f} s; "
        f"step times {['%.1f' % s for s in result['step_s']]}"
    )
    est = (result["estimate"] or {}).get("roles", {})
    print(
        f"{'role':16s} {'n':>2s} {'peak RSS GiB':>12s} {'peak PSS GiB':>12s} {'at peak GiB':>11s} {'B/param':>8s} "
        f"{'estimate GiB':>12s}"
    )
    for role, r in result["roles"].items():
        e = est.get(role)
        print(
            f"{role:16s} {r['processes']:2d} {r['peak_rss_bytes'] / GIB:12.2f} {r['peak_pss_bytes'] / GIB:12.2f} "
            f"{r['pss_at_total_peak_bytes'] / GIB:11.2f} {r['peak_pss_bytes'] / params:8.1f} "
            f"{'' if e is None else f'{e / GIB:12.2f}'}"
        )
    total = result["peak_total_pss_bytes"]
    print(
        f"{'summed PSS':16s}    {'':12s} {total / GIB:12.2f} {'':11s} {total / params:8.1f} "
        f"{'' if not est else f'{sum(est.values()) / GIB:12.2f}'}"
    )
    print(
        f"object store peak {result['peak_object_store_bytes'] / GIB:.2f} GiB; principled "
        f"{result['principled_bytes'] / GIB:.2f} GiB ({result['principled_bytes'] / params:.0f} B/param); "
        f"summed PSS / principled = {result['pss_over_principled']:.2f}"
    )


def estimate_for(repo: Path, args_list: list[str], env: dict) -> dict | None:
    """The preflight's per-role estimate of the run (the tree's dppo.launch.preflight.memory_estimate), if it has one."""
    code = (
        "import json,sys; from dppo.config.load import load_config; from dppo.data import make_prompt_source; "
        "from dppo.launch import preflight as p; cfg = load_config(sys.argv[1:]); "
        "from dppo.launch.plan import plan_run; e = p.memory_estimate(plan_run(cfg, make_prompt_source(cfg))); "
        "print(json.dumps({'roles': e.by_role(), 'total': e.total_bytes}))"
    )
    out = subprocess.run([sys.executable, "-c", code, *args_list], env=env, capture_output=True, text=True, cwd=repo)
    if out.returncode != 0:
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repo", type=Path, default=REPO, help="the dppo tree to run (default: this one)")
    parser.add_argument("--malloc-tuning", choices=["0", "1"], default="1")
    parser.add_argument("--model-dir", type=Path, default=None, help="reuse a model saved by an earlier run")
    parser.add_argument("--out", type=Path, default=REPO / "bench_out" / "memory.json")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="dppo-memory-bench."))
    model_dir = args.model_dir or work / "model"
    if args.model_dir is None or not (model_dir / "config.json").exists():
        params = build_model_dir(args.shape, model_dir)
    else:
        params = (
            json.loads((model_dir / "params.json").read_text())["params"]
            if (model_dir / "params.json").exists()
            else build_model_dir(args.shape, model_dir)
        )
    (model_dir / "params.json").write_text(json.dumps({"params": params}))
    env = {**os.environ, "PYTHONPATH": str(args.repo), "HF_HUB_OFFLINE": "1", "DPPO_MALLOC_TUNING": args.malloc_tuning}
    run_dir = work / "run"
    targs = train_args(model_dir, run_dir, args.dtype, args.world_size, args.steps)
    estimate = estimate_for(args.repo, targs, env)
    sampler, code, wall_s = run_and_sample(
        [sys.executable, "-m", "dppo", "train", *targs], env, work / "train.log", args.repo
    )
    dtype_bytes = 4 if args.dtype == "float32" else 2
    result = {
        "label": f"{args.shape} {args.dtype} world size {args.world_size} malloc tuning {args.malloc_tuning} "
        f"({args.repo})",
        "exit_code": code,
        "wall_s": wall_s,
        "step_s": step_times(run_dir),
        "log_tail": (work / "train.log").read_text()[-1500:],
        "load": os.getloadavg()[0],
        **summarize(sampler, params, dtype_bytes, estimate),
    }
    print_table(result)
    if code != 0:
        print(result["log_tail"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"json: {args.out}; model: {model_dir}")
    return result


if __name__ == "__main__":
    main()
