"""Which held-out problems can the model solve at all? pass@k up to k=64 and the greedy answers, by kind of problem.

Issue 35 asks `make real` for held-out greedy accuracy 0.7; every run so far levels off near 0.64. RL of this kind
sharpens what the model already samples: a problem none of whose samples is right gives no gradient. This script
measures, for a model directory (the imported base model, or a run's hf_model/), each held-out problem's number of
right answers among N samples at the rollout's temperature, the unbiased pass@k (Chen et al. 2021) from them, and the
greedy answer; then both by kind of problem (addition with or without a carry, subtraction with or without a borrow,
negative results).

    .venv-vllm/bin/python benchmarks/real_coverage.py --model DIR [--n 64] [--json OUT] [--greedy-out OUT.jsonl] \
        [key=value ...]

It uses the config of `make real` (examples/real/smollm2_arithmetic.yaml) and the engine of the run (rollout.name=vllm
in bf16 by default, as real_run.py sets it).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from math import comb
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "examples" / "real" / "smollm2_arithmetic.yaml"
KS = (1, 4, 8, 16, 32, 64)
_PROBLEM = re.compile(r"(-?\d+)\s*([+-])\s*(-?\d+)")


# ---- pure parts (tests/unit/benchmarks/test_real_coverage.py) ---------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of the chance that at least one of k samples is right, from c right among n (k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n: n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def kind(question: str) -> str:
    """The kind of a two-term problem: 'add, carry', 'add, no carry', 'sub, borrow', 'sub, no borrow', with
    ', negative' where the result is below zero (a - b with b > a)."""
    match = _PROBLEM.search(question)
    if match is None:
        raise ValueError(f"not a two-term + or - problem: {question!r}")
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    if op == "+":
        return "add, carry" if (abs(a) % 10 + abs(b) % 10) >= 10 else "add, no carry"
    big, small = max(a, b), min(a, b)
    label = "sub, borrow" if big % 10 < small % 10 else "sub, no borrow"
    return label + (", negative" if a - b < 0 else "")


def summarize(questions: list[str], right: list[int], greedy: list[bool], n: int) -> dict:
    """pass@k for KS (k <= n) and greedy accuracy, over all problems and by kind; right[i] of n samples were right."""

    def figures(idx: list[int]) -> dict:
        out = {"problems": len(idx), "greedy": sum(greedy[i] for i in idx) / len(idx)}
        for k in KS:
            if k <= n:
                out[f"pass@{k}"] = sum(pass_at_k(n, right[i], k) for i in idx) / len(idx)
        out["never_right"] = sum(right[i] == 0 for i in idx) / len(idx)
        return out

    kinds: dict[str, list[int]] = {}
    for i, q in enumerate(questions):
        kinds.setdefault(kind(q), []).append(i)
    return {"all": figures(list(range(len(questions)))), "by_kind": {k: figures(v) for k, v in sorted(kinds.items())}}


def table(result: dict) -> str:
    cols = [c for c in result["all"] if c != "problems"]
    lines = ["| problems | n | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for name, fig in [("all", result["all"]), *result["by_kind"].items()]:
        lines.append(f"| {name} | {fig['problems']} | " + " | ".join(f"{fig[c]:.3f}" for c in cols) + " |")
    return "\n".join(lines)


# ---- the measurement ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a transformers model directory")
    parser.add_argument("--n", type=int, default=64, help="samples per problem (default %(default)s)")
    parser.add_argument("--config", default=str(CONFIG))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument(
        "--greedy-out",
        help="write each problem's greedy response here (JSON lines: kind, question, answer, response, right)",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)

    import numpy as np
    import torch

    from dppo.config import load_config
    from dppo.data import make_prompt_source
    from dppo.data.reasoning_gym import split_entries
    from dppo.models import build_model
    from dppo.trainer.rollout.settings import engine_settings
    from dppo.workers.rollout.engine_config import make_engine

    torch.set_num_threads(args.threads)
    overrides = [f"model.path={args.model}", "rollout.name=vllm", "rollout.dtype=bfloat16", *args.overrides]
    cfg = load_config(overrides, config_file=args.config)
    start = time.perf_counter()
    source = make_prompt_source(cfg)
    _, entries = split_entries(cfg.data.reasoning_gym, cfg.trainer.seed)
    questions = [e["question"] for e in entries]
    prompts = source.eval_prompts()
    model = build_model(cfg.model, source.vocab_size, seed=cfg.trainer.seed)
    engine = make_engine(cfg.rollout.name, engine_settings(cfg, source), model.config)
    right, greedy = [0] * len(prompts), [False] * len(prompts)
    try:
        engine.load_weights(model.state_dict())
        responses, mask = engine.greedy([np.asarray(p) for p in prompts.token_ids])
        acc = source.score(prompts, responses.numpy(), mask.numpy()).extra["acc"]
        greedy = [bool(a == 1.0) for a in acc]
        if args.greedy_out:
            with open(args.greedy_out, "w") as out:
                texts = source.decode(responses.numpy(), mask.numpy())
                for entry, text, ok in zip(entries, texts, greedy):
                    line = {"kind": kind(entry["question"]), "question": entry["question"], "answer": entry["answer"]}
                    out.write(json.dumps({**line, "response": text, "right": ok}) + "\n")
        per_batch = 32
        for lo in range(0, len(prompts), per_batch):
            chunk = prompts[lo : lo + per_batch]
            engine.seed(cfg.trainer.seed + lo)
            samples = engine.sample([np.asarray(p) for p in chunk.token_ids], args.n)
            acc = source.score(chunk.repeat(args.n), samples.responses.numpy(), samples.response_mask.numpy())
            rows = acc.extra["acc"].reshape(len(chunk), args.n)  # prompt-major, as chunk.repeat(n) lays them out
            for j, row in enumerate(rows):
                right[lo + j] = int((row == 1.0).sum())
            print(f"  {min(lo + per_batch, len(prompts))}/{len(prompts)} problems sampled", file=sys.stderr, flush=True)
    finally:
        engine.close()
    result = summarize(questions, right, greedy, args.n)
    result.update(model=args.model, n=args.n, seconds=time.perf_counter() - start, right=right, greedy_right=greedy)
    print(
        f"{args.model}: {args.n} samples a problem at temperature {cfg.rollout.temperature}, {result['seconds']:.0f} s"
    )
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
