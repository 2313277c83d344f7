"""Rollout engines, hf vs vllm, on the same model and prompts in one run (issue 17). Run it in .venv-vllm:

    make vllm && .venv-vllm/bin/python benchmarks/rollout_bench.py [--sizes tiny 42m] [--dtypes float32 bfloat16]

1. Generation: tokens/s of each engine (rollout.n samples of max_new_tokens for each prompt, no EOS, so every
   sample has its full length); target at ~40M on the CPU: vllm >= 4x hf, at the shape of issue 17's own
   measurement by default (64 prompts x 8 samples, 64 new tokens). Also tokens per CPU-second: on a shared
   machine, run with --threads 1 and compare those (the work each engine does, not the share of the cores it
   got). And the ceiling, measured in the same run: the tokens/s of a forward pass per token whose matmuls all
   run at the best matmul rate of this machine, dtype and thread count (torch's and vLLM's oneDNN kernel at a
   decode step's shape), with no prefill, attention or sampling; each engine's share of it says how much
   faster generation could still get.
2. Weight sync (vllm engine): seconds and bytes of full vs delta sync over a few cycles whose weights change
   by Adam steps of the trainer at a given lr (fp32 trainer weights, engine in its dtype), published through
   Ray's object store as the trainer's rank 0 does (delta: computed there, against the previous publish) and
   loaded as a rollout worker does; and the fraction of engine-dtype elements that changed: when delta pays.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dppo.models import DTYPES, tiny_model_config  # noqa: E402
from dppo.workers.actor.publish_delta import DeltaPublisher  # noqa: E402
from dppo.workers.rollout.engines.hf import HFEngine  # noqa: E402
from dppo.workers.rollout.engines.vllm import VLLMEngine  # noqa: E402
from dppo.workers.rollout.ray_worker import load_published  # noqa: E402

# name -> (hidden_size, num_hidden_layers, num_attention_heads, intermediate_size); head size >= 32 (vLLM CPU)
SIZES = {"tiny": (64, 2, 2, 128), "42m": (512, 10, 8, 2048)}
VOCAB = 1024
TARGET = 4.0  # issue 17: vllm >= 4x hf tokens/s at ~40M on this CPU


def _model(size: str):
    from transformers import Qwen2ForCausalLM

    hidden, layers, heads, inter = SIZES[size]
    torch.manual_seed(0)
    return Qwen2ForCausalLM(tiny_model_config(VOCAB, hidden, layers, heads, inter, max_position_embeddings=256)).eval()


def forward_flops(model) -> int:
    """Matmul FLOPs of one token's forward pass: 2 x the weights of every nn.Linear, the lm_head's included (the
    input embedding is a lookup; attention's score and value products, small at these lengths, are left out)."""
    return 2 * sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def _best_rate(matmul, flops: int, repeats: int) -> float:
    matmul()  # warm-up (oneDNN picks and packs its kernel)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul()
        best = min(best, time.perf_counter() - start)
    return flops / best


def matmul_ceiling(model, rows: int, dtype: str, repeats: int = 10) -> tuple[float, dict[str, float]]:
    """FLOP/s of the best matmul kernel here for a decode step of `rows` sequences through model's Linear layers
    (each layer's own (rows x in) @ (in x out), in dtype), at this process's thread count: torch's F.linear and,
    where vLLM is installed, the oneDNN kernel vLLM's CPU build uses for unquantized layers. (best, by kernel)."""
    dt = DTYPES[dtype]
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weights = {tuple(m.weight.shape): m.weight.detach().to(dt).contiguous() for m in linears}
    count = {shape: sum(tuple(m.weight.shape) == shape for m in linears) for shape in weights}
    inputs = {shape: torch.randn(rows, shape[1]).to(dt) for shape in weights}
    flops = sum(2 * rows * out * inp * count[(out, inp)] for out, inp in weights)

    def torch_pass():
        for shape, w in weights.items():
            for _ in range(count[shape]):
                torch.nn.functional.linear(inputs[shape], w)

    rates = {"torch": _best_rate(torch_pass, flops, repeats)}
    try:
        from vllm import _custom_ops as ops
    except ImportError:
        ops = None
    if ops is not None and getattr(ops, "_supports_onednn", False):
        handlers = {shape: ops.create_onednn_mm(w.t(), 32) for shape, w in weights.items()}

        def onednn_pass():
            for shape, handler in handlers.items():
                for _ in range(count[shape]):
                    ops.onednn_mm(handler, inputs[shape], None)

        rates["vllm onednn"] = _best_rate(onednn_pass, flops, repeats)
    return max(rates.values()), rates


def _tokens_per_s(engine, prompts, n: int, repeats: int) -> tuple[float, float]:
    """(tokens per second, tokens per CPU-second of this process), each the best of `repeats` tickets. Per CPU-second
    is the one to compare on a loaded machine at --threads 1 (no threads spin-waiting): it counts the work only."""
    engine.seed(0)
    engine.sample(prompts[:2], 2)  # warm-up
    best, best_cpu = 0.0, 0.0
    for r in range(repeats):
        engine.seed(r)
        start, start_cpu = time.perf_counter(), time.process_time()
        samples = engine.sample(prompts, n)
        tokens = int(samples.response_mask.sum())
        best = max(best, tokens / (time.perf_counter() - start))
        best_cpu = max(best_cpu, tokens / (time.process_time() - start_cpu))
    return best, best_cpu


def _adam_cycles(model, lr: float, cycles: int):
    """State dicts after each of `cycles` Adam steps on a language-model loss over random tokens."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    for _ in range(cycles):
        ids = torch.randint(0, VOCAB, (4, 32), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        yield {k: v.detach().clone() for k, v in model.state_dict().items()}


def bench_generation(size, dtype, args) -> dict:
    model = _model(size)
    prompts = [np.random.default_rng(p).integers(0, VOCAB, args.prompt_len) for p in range(args.prompts)]
    hf = HFEngine(model.config, dtype, 1.0, args.new_tokens, None, 0, micro_batch_size=64)
    hf.load_weights(model.state_dict())
    hf_tps, hf_cpu = _tokens_per_s(hf, prompts, args.n, args.repeats)
    del hf
    vllm = VLLMEngine(
        model.config,
        dtype,
        1.0,
        args.new_tokens,
        None,
        0,
        max_num_seqs=args.prompts * args.n,
        max_prompt_len=args.prompt_len,
        compile=args.vllm_compile,
    )
    vllm.load_weights(model.state_dict())
    vllm_tps, vllm_cpu = _tokens_per_s(vllm, prompts, args.n, args.repeats)
    vllm.close()
    params = sum(p.numel() for p in model.parameters())
    rate, rates = matmul_ceiling(model, args.prompts * args.n, dtype)
    return {
        "size": size,
        "params_m": params / 1e6,
        "dtype": dtype,
        "hf_tok_s": hf_tps,
        "vllm_tok_s": vllm_tps,
        "hf_tok_cpu_s": hf_cpu,
        "vllm_tok_cpu_s": vllm_cpu,
        "ceiling_tok_s": rate / forward_flops(model),
        "matmul_gflops": {k: v / 1e9 for k, v in rates.items()},
    }


def bench_sync(size, dtype, lr, args) -> list[dict]:
    """Each cycle's weights published as the trainer's rank 0 does (into Ray's object store; with delta, the
    publisher's delta against its previous publish next to them) and loaded as a rollout worker does: MB = what
    the engine read (full: the fp32 state dict; delta: the delta), s = the worker's load, publish s = rank 0's
    put (and delta computation)."""
    import ray

    rows = []
    for mode in ("full", "delta"):
        model = _model(size)
        engine = VLLMEngine(model.config, dtype, 1.0, 8, None, 0, weight_sync=mode, max_num_seqs=8)
        publisher = DeltaPublisher(DTYPES[dtype]) if mode == "delta" else None

        def publish(state):
            start, rss = time.perf_counter(), _reset_peak_rss()
            ref = ray.put(state)
            published = publisher.publish(state, ref) if publisher else [ref]
            return published, time.perf_counter() - start, _peak_rss() - rss

        published, _, _ = publish(model.state_dict())
        _, holds = load_published(engine, published, None)  # the first sync is full either way
        for cycle, state in enumerate(_adam_cycles(model, lr, args.cycles)):
            published, publish_s, publish_rss = publish(state)
            sync, holds = load_published(engine, published, holds)
            rows.append(
                {
                    "size": size,
                    "dtype": dtype,
                    "lr": lr,
                    "mode": mode,
                    "cycle": cycle,
                    "s": sync.seconds,
                    "publish_s": publish_s,
                    "publish_mb": publish_rss / 2**20,
                    "mb": sync.bytes / 2**20,
                    "changed": sync.changed_fraction,
                }
            )
        engine.close()
    return rows


def _rss_field(name: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(name))


def _reset_peak_rss() -> int:
    """Reset this process's peak RSS (VmHWM) to its RSS now, which it returns (Linux)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _rss_field("VmRSS:")


def _peak_rss() -> int:
    return _rss_field("VmHWM:")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--lrs", nargs="+", type=float, default=[1e-3, 1e-5, 1e-6])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of both engines")
    parser.add_argument("--vllm-compile", action="store_true", help="the vllm engine with torch.compile (not eager)")
    parser.add_argument("--skip-generation", action="store_true")
    parser.add_argument("--skip-sync", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    print(
        f"# rollout_bench {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {args.prompts} prompts x n={args.n}, "
        f"{args.prompt_len} prompt + {args.new_tokens} new tokens, {args.threads} threads"
    )
    if not args.skip_generation:
        print(
            "| model | params | dtype | hf tok/s | vllm tok/s | vllm / hf | hf tok/cpu-s | vllm tok/cpu-s | "
            "vllm / hf (cpu) | ceiling tok/s | hf, vllm of ceiling | matmul GFLOP/s |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|"
        )
        verdicts = []
        for size in args.sizes:
            for dtype in args.dtypes:
                r = bench_generation(size, dtype, args)
                ratio = r["vllm_tok_s"] / r["hf_tok_s"]
                gflops = ", ".join(f"{k} {v:.0f}" for k, v in r["matmul_gflops"].items())
                print(
                    f"| {size} | {r['params_m']:.1f}M | {dtype} | {r['hf_tok_s']:.0f} | {r['vllm_tok_s']:.0f} | "
                    f"{ratio:.1f}x | {r['hf_tok_cpu_s']:.0f} | {r['vllm_tok_cpu_s']:.0f} | "
                    f"{r['vllm_tok_cpu_s'] / r['hf_tok_cpu_s']:.1f}x | {r['ceiling_tok_s']:.0f} | "
                    f"{r['hf_tok_s'] / r['ceiling_tok_s']:.0%}, {r['vllm_tok_s'] / r['ceiling_tok_s']:.0%} | "
                    f"{gflops} |",
                    flush=True,
                )
                if r["params_m"] > 20:  # the target is set at ~40M
                    verdicts.append(f"{size} {dtype} {'PASS' if ratio >= TARGET else 'FAIL'} {ratio:.1f}x")
        if verdicts:
            print(f"\ntarget vllm >= {TARGET:g}x hf tokens/s at ~40M: {'; '.join(verdicts)}")
    if args.skip_sync:
        return
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="WARNING")
    print(
        "\n| model | engine dtype | lr | sync | MB read per cycle | load s | publish s | publish peak RSS + MB | "
        "changed fraction |\n|---|---|---|---|---|---|---|---|---|"
    )
    for size in args.sizes:
        for dtype in args.dtypes:
            for lr in args.lrs:
                rows = bench_sync(size, dtype, lr, args)
                for mode in ("full", "delta"):
                    mine = [r for r in rows if r["mode"] == mode]
                    print(
                        f"| {size} | {dtype} | {lr:g} | {mode} | {np.mean([r['mb'] for r in mine]):.2f} | "
                        f"{np.mean([r['s'] for r in mine]):.3f} | {np.mean([r['publish_s'] for r in mine]):.3f} | "
                        f"{max(r['publish_mb'] for r in mine):.0f} | "
                        f"{', '.join(format(r['changed'], '.3f') for r in mine)} |",
                        flush=True,
                    )
    ray.shutdown()


if __name__ == "__main__":
    main()
