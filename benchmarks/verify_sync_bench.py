"""What does rollout.verify_sync cost, against the weight sync it checks, on SmolLM2-135M-shaped weights?

A bf16 (or --dtype) vllm engine of SmolLM2-135M's architecture (LlamaConfig: hidden 576, 30 layers, 9 heads, 3 kv
heads, intermediate 1536, vocab 49152, tied embeddings; random weights) syncs with rollout.weight_sync=delta: a full
first load, then --cycles deltas that change 2 layers (one q_proj, one down_proj). Per sync: the load's seconds, the
worker's check (read back from the engine + checksums + compare: dppo.workers.rollout.worker.check_load's work) and
the trainer's fingerprint of the publish (fp32 weights checksummed in the engine's dtype), and the plain copy of the
fp32 weights as the floor a publish costs anyway (LocalRollout copies them into shared memory). Runs in .venv-vllm.

    .venv-vllm/bin/python benchmarks/verify_sync_bench.py [--dtype bfloat16] [--cycles 2] [--out verify_sync.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dppo.workers.rollout.engines.vllm import VLLMEngine
from dppo.workers.sync_check import verify
from dppo.workers.weight_delta import weight_delta
from dppo.workers.weight_fingerprint import fingerprint

CHANGED = ("model.layers.3.self_attn.q_proj.weight", "model.layers.7.mlp.down_proj.weight")


def smollm2_135m_state(seed: int = 0) -> tuple[object, dict[str, torch.Tensor]]:
    """SmolLM2-135M's config (random weights, tied embeddings) and its fp32 state dict (copies: a publish's)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    return config, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--cycles", type=int, default=2)
    parser.add_argument("--out", default=None, help="a JSON file of the rows")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    config, state = smollm2_135m_state()
    params = sum(t.numel() for name, t in state.items() if name != "lm_head.weight")
    engine = VLLMEngine(config, args.dtype, 1.0, 8, None, 0, weight_sync="delta", max_num_seqs=8, max_prompt_len=32)
    print(
        f"# verify_sync_bench {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {params / 1e6:.1f}M params, "
        f"{args.dtype} engine, {torch.get_num_threads()} torch threads"
    )
    print(
        "| sync | load s | check s (worker) | check / load | fingerprint s (trainer) | fp32 copy s |\n|---|---|---|---|---|---|"
    )
    rows = []
    try:
        for cycle in range(args.cycles + 1):
            new = {k: v.clone() for k, v in state.items()}
            for name in CHANGED if cycle else ():
                new[name] += 0.5
            expected, fingerprint_s = _timed(lambda: fingerprint(new, dtype))
            _, copy_s = _timed(lambda: {k: v.clone() for k, v in new.items()})
            if cycle == 0:
                sync = engine.load_weights(new)
            else:
                sync = engine.load_delta(weight_delta(state, new, dtype, str(cycle - 1), str(cycle)))
            held, check_s = _timed(lambda: engine.held_prints(expected))
            verify(expected, held, cycle)
            kind = "full" if cycle == 0 else f"delta ({len(CHANGED)} layers)"
            rows.append(
                {
                    "sync": kind,
                    "load_s": sync.seconds,
                    "check_s": check_s,
                    "fingerprint_s": fingerprint_s,
                    "copy_s": copy_s,
                }
            )
            print(
                f"| {kind} | {sync.seconds:.3f} | {check_s:.3f} | {check_s / sync.seconds:.2f} | "
                f"{fingerprint_s:.3f} | {copy_s:.3f} |",
                flush=True,
            )
            state = new
    finally:
        engine.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
