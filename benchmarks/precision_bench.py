"""How much faster, and how much smaller, are the actor's update and its old-log-prob pass in bf16 compute
(actor.mixed_precision=bfloat16) than in fp32, on a real model? (issue 35, point 4)

    python benchmarks/precision_bench.py --model-path DIR [--rows 32] [--prompt 46] [--response 12]
        [--micro 32 8] [--repeats 3] [--threads 1] [--out bench_out/precision.json]

Loads the model (dppo.models.build_model, fp32) into this process and runs, on one random batch of --rows sequences of
--prompt + --response tokens (a trigger of issue 35's run: 4 groups x 8 samples, 46 + 12 tokens), ActorRank's own
calls: the old-log-prob pass (no grad, dppo.models.response_log_probs under the rank's Precision) and one update
(dppo.workers.actor.update.update_policy: forward, Decoupled PPO's loss, backward, fused AdamW step), for each
actor.mixed_precision (null, bfloat16) and each --micro (actor.micro_batch_size), the configurations alternating within
each repeat after one warm-up round. Beside them the machine's matmul ceiling in the same run: GFLOP/s of a
(rows x tokens, hidden) x (hidden, intermediate) product in fp32 and in bf16 (MKL and oneDNN on the CPU).

Per configuration: the medians of the pass's and the update's seconds, tokens/s (rows x (prompt + response) / s), and
the bytes a micro-batch's forward saves for its backward (torch's saved tensors, each storage once, the parameters
left out: the activations, the logits and autocast's bf16 copies of the weights). A table and a JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from dppo.algo import RolloutCorrectionConfig, log_probs_from_logits
from dppo.config import ActorConfig
from dppo.models import build_model, forward_response_logits, response_log_probs
from dppo.batch import TrainBatch
from dppo.workers.actor.precision import Precision
from dppo.workers.actor.update import decoupled_objective, update_policy

REPO = Path(__file__).resolve().parent.parent
GIB = 2**30


class SavedBytes:
    """Within: the bytes the autograd graph saves for the backward, each storage once, the model's parameters left
    out (torch.autograd.graph.saved_tensors_hooks). The graph made within cannot run backward: the hook hands the
    graph nothing (handing it the tensor itself would tie an op's saved output to its own node, a cycle that is never
    freed: the bench grew by the saved bytes every round) and keeps the tensor here instead, as the graph would have
    (a freed storage's address could be another's next), until the block ends."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages: dict[int, int] = {}
        self.kept: list[torch.Tensor] = []

    def pack(self, t: torch.Tensor) -> None:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.params:
            self.storages[ptr] = t.untyped_storage().nbytes()
            self.kept.append(t)

    @staticmethod
    def unpack(_: None) -> torch.Tensor:
        raise RuntimeError("a graph measured by SavedBytes keeps no tensors for a backward")

    def __enter__(self) -> SavedBytes:
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)
        self.kept.clear()

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())


def matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype, repeats: int = 5) -> float:
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * m * k * n / statistics.median(times) / 1e9


def make_batch(rows: int, prompt: int, response: int, vocab: int) -> TrainBatch:
    gen = torch.Generator().manual_seed(0)
    return TrainBatch(
        input_ids=torch.randint(0, vocab, (rows, prompt + response), generator=gen),
        response_mask=torch.ones(rows, response, dtype=torch.bool),
        behav_logp=-2 * torch.rand(rows, response, generator=gen),
        scores=torch.rand(rows, generator=gen),
        group_index=torch.arange(rows) // 8,
        versions=torch.zeros(rows, dtype=torch.long),
    )


def run_config(model, optimizer, batch, precision: Precision, micro: int) -> dict:
    """One old-log-prob pass and one update of model in precision: their seconds, and the bytes the training forward
    of one micro-batch (as update_policy runs it) saves for its backward."""
    response = batch.response_length
    start = time.perf_counter()
    with torch.no_grad(), precision.forward():
        prox = response_log_probs(model, batch.input_ids, response, 1.0, micro)  # (B, R)
    score_s = time.perf_counter() - start
    actor_cfg = ActorConfig(micro_batch_size=micro, lr=1e-7)  # a small step: the weights stay about where they were
    advantages = torch.randn(prox.shape, generator=torch.Generator().manual_seed(1))
    objective = decoupled_objective(actor_cfg, RolloutCorrectionConfig())(batch, prox, advantages)
    start = time.perf_counter()
    update_policy(model, optimizer, batch, objective, actor_cfg, 1.0, precision=precision)
    update_s = time.perf_counter() - start
    with SavedBytes(model) as saved:  # apart from the timed update: the hooks cost a little
        with precision.forward():
            logits = forward_response_logits(model, batch.input_ids[:micro], response)  # (b, R, V)
        log_probs_from_logits(logits, batch.input_ids[:micro, -response:])
    return {"score_s": score_s, "update_s": update_s, "saved_bytes": saved.nbytes}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=46)
    parser.add_argument("--response", type=int, default=12)
    parser.add_argument("--micro", type=int, nargs="+", default=[32, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (trainer.num_threads; default 1)")
    parser.add_argument("--out", type=Path, default=REPO / "bench_out" / "precision.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build_model(SimpleNamespace(path=args.model_path, dtype="float32"), 0, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7, fused=True)
    cfg = model.config
    batch = make_batch(args.rows, args.prompt, args.response, cfg.vocab_size)
    tokens = args.rows * (args.prompt + args.response)
    configs = [(p, m) for m in args.micro for p in (None, "bfloat16")]
    samples: dict[tuple, list[dict]] = {c: [] for c in configs}
    ceiling = {"float32": [], "bfloat16": []}
    for repeat in range(args.repeats + 1):  # the first round warms up (kernels, allocator) and is not counted
        order = configs if repeat % 2 == 0 else list(reversed(configs))
        for p, m in order:
            result = run_config(model, optimizer, batch, Precision.of(p, False, "cpu"), m)
            if repeat:
                samples[(p, m)].append(result)
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            gflops = matmul_gflops(tokens, cfg.hidden_size, cfg.intermediate_size, dtype)
            if repeat:
                ceiling[name].append(gflops)
    rows = []
    for (p, m), runs in samples.items():
        score_s = statistics.median(r["score_s"] for r in runs)
        update_s = statistics.median(r["update_s"] for r in runs)
        rows.append(
            {
                "mixed_precision": p,
                "micro_batch_size": m,
                "score_s": score_s,
                "update_s": update_s,
                "score_tokens_per_s": tokens / score_s,
                "update_tokens_per_s": tokens / update_s,
                "saved_per_micro_bytes": max(r["saved_bytes"] for r in runs),
                "runs": runs,
            }
        )
    result = {
        "model": args.model_path,
        "rows": args.rows,
        "tokens": tokens,
        "threads": args.threads,
        "load": os.getloadavg(),
        "matmul_gflops": {k: statistics.median(v) for k, v in ceiling.items()},
        "configs": rows,
    }
    print(
        f"{args.rows} rows x {args.prompt} + {args.response} tokens, {args.threads} thread(s), load {result['load'][0]:.2f}; "
        f"matmul ceiling fp32 {result['matmul_gflops']['float32']:.0f}, bf16 {result['matmul_gflops']['bfloat16']:.0f} "
        "GFLOP/s"
    )
    print(
        f"{'precision':10s} {'micro':>5s} {'pass s':>7s} {'tok/s':>6s} {'update s':>8s} {'tok/s':>6s} "
        f"{'saved GiB':>9s} (a micro-batch's, for its backward)"
    )
    for r in rows:
        print(
            f"{str(r['mixed_precision']):10s} {r['micro_batch_size']:5d} {r['score_s']:7.2f} {r['score_tokens_per_s']:6.0f} "
            f"{r['update_s']:8.2f} {r['update_tokens_per_s']:6.0f} {r['saved_per_micro_bytes'] / GIB:9.2f}"
        )
    for m in args.micro:
        a = next(r for r in rows if r["micro_batch_size"] == m and r["mixed_precision"] is None)
        b = next(r for r in rows if r["micro_batch_size"] == m and r["mixed_precision"] == "bfloat16")
        print(
            f"micro {m}: bf16 / fp32 time: pass {b['score_s'] / a['score_s']:.2f}x, update {b['update_s'] / a['update_s']:.2f}x"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"json: {args.out}")
    return result


if __name__ == "__main__":
    main()
