"""Rollout engines, hf vs vllm, on the same model and prompts in one run (issue 17). Run it in .venv-vllm:

    make vllm && .venv-vllm/bin/python benchmarks/rollout_bench.py [--sizes tiny 42m] [--dtypes float32 bfloat16]

1. Generation: tokens/s of each engine (rollout.n samples of max_new_tokens for each prompt, no EOS, so every
   sample has its full length); target at ~40M on the CPU: vllm >= 4x hf. Also tokens per CPU-second: on a
   shared machine, run with --threads 1 and compare those (the work each engine does, not the share of the
   cores it got).
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
from dppo.workers.rollout.worker import load_published  # noqa: E402

# name -> (hidden_size, num_hidden_layers, num_attention_heads, intermediate_size); head size >= 32 (vLLM CPU)
SIZES = {"tiny": (64, 2, 2, 128), "42m": (512, 10, 8, 2048)}
VOCAB = 1024


def _model(size: str):
    from transformers import Qwen2ForCausalLM

    hidden, layers, heads, inter = SIZES[size]
    torch.manual_seed(0)
    return Qwen2ForCausalLM(tiny_model_config(VOCAB, hidden, layers, heads, inter, max_position_embeddings=256)).eval()


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
    vllm = VLLMEngine(model.config, dtype, 1.0, args.new_tokens, None, 0, max_num_seqs=args.prompts * args.n,
                      max_prompt_len=args.prompt_len, compile=args.vllm_compile)  # fmt: skip
    vllm.load_weights(model.state_dict())
    vllm_tps, vllm_cpu = _tokens_per_s(vllm, prompts, args.n, args.repeats)
    vllm.close()
    params = sum(p.numel() for p in model.parameters())
    return {"size": size, "params_m": params / 1e6, "dtype": dtype, "hf_tok_s": hf_tps, "vllm_tok_s": vllm_tps,
            "hf_tok_cpu_s": hf_cpu, "vllm_tok_cpu_s": vllm_cpu}


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
            rows.append({"size": size, "dtype": dtype, "lr": lr, "mode": mode, "cycle": cycle, "s": sync.seconds,
                         "publish_s": publish_s, "publish_mb": publish_rss / 2**20, "mb": sync.bytes / 2**20,
                         "changed": sync.changed_fraction})  # fmt: skip
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
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of both engines")
    parser.add_argument("--vllm-compile", action="store_true", help="the vllm engine with torch.compile (not eager)")
    parser.add_argument("--skip-generation", action="store_true")
    parser.add_argument("--skip-sync", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    print(f"# rollout_bench {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {args.prompts} prompts x n={args.n}, "
          f"{args.prompt_len} prompt + {args.new_tokens} new tokens, {args.threads} threads")  # fmt: skip
    if not args.skip_generation:
        print("| model | params | dtype | hf tok/s | vllm tok/s | vllm / hf | hf tok/cpu-s | vllm tok/cpu-s | vllm / hf (cpu) |\n"
              "|---|---|---|---|---|---|---|---|---|")
        for size in args.sizes:
            for dtype in args.dtypes:
                r = bench_generation(size, dtype, args)
                print(f"| {size} | {r['params_m']:.1f}M | {dtype} | {r['hf_tok_s']:.0f} | {r['vllm_tok_s']:.0f} | "
                      f"{r['vllm_tok_s'] / r['hf_tok_s']:.1f}x | {r['hf_tok_cpu_s']:.0f} | {r['vllm_tok_cpu_s']:.0f} | "
                      f"{r['vllm_tok_cpu_s'] / r['hf_tok_cpu_s']:.1f}x |", flush=True)  # fmt: skip
    if args.skip_sync:
        return
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="WARNING")
    print("\n| model | engine dtype | lr | sync | MB read per cycle | load s | publish s | publish peak RSS + MB | "
          "changed fraction |\n|---|---|---|---|---|---|---|---|---|")
    for size in args.sizes:
        for dtype in args.dtypes:
            for lr in args.lrs:
                rows = bench_sync(size, dtype, lr, args)
                for mode in ("full", "delta"):
                    mine = [r for r in rows if r["mode"] == mode]
                    print(f"| {size} | {dtype} | {lr:g} | {mode} | {np.mean([r['mb'] for r in mine]):.2f} | "
                          f"{np.mean([r['s'] for r in mine]):.3f} | {np.mean([r['publish_s'] for r in mine]):.3f} | "
                          f"{max(r['publish_mb'] for r in mine):.0f} | "
                          f"{', '.join(format(r['changed'], '.3f') for r in mine)} |", flush=True)  # fmt: skip
    ray.shutdown()


if __name__ == "__main__":
    main()
