"""How close `dppo replay` gets with the vllm engine (issue 46): an async run with vLLM in a local rollout process, its
samples recorded, replayed with its schedule (the replay's vLLM engine in the trainer's process), the replay's samples
recorded too, and the two compared ticket by ticket.

    .venv-vllm/bin/python benchmarks/replay_vllm.py [--steps 8] [--out DIR] [key=value ...]

Prints and writes OUT/replay_vllm.json: the fraction of groups whose responses are token for token the run's, the
largest |behav_logp difference| over those, the first step whose metrics differ, and the final weights' largest
difference. (Run in .venv-vllm: `make vllm`.)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from dppo.trainer.schedule import read_samples

TINY = [
    "trainer.parameter_sync_step=2",
    "trainer.train_batch_size=16",
    "trainer.progress_bar=false",
    "trainer.eval_prompts=16",
    "trainer.record_samples=true",
    "ray.enabled=false",
    "rollout.name=vllm",
    "rollout.n=8",
    "rollout.groups_per_batch=8",
    "task.length=2",
    "model.hidden_size=64",
    "model.num_hidden_layers=1",
    "model.num_attention_heads=2",
    "model.intermediate_size=128",
]


def dppo(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "dppo", *args], capture_output=True, text=True, check=False)
    if proc.returncode not in (0, 7):
        sys.exit(f"dppo {args[0]} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return proc.stdout


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("bench_out/replay_vllm"))
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    run, replayed = args.out / "run", args.out / "replay"
    dppo("train", f"trainer.output_dir={run}", f"trainer.total_steps={args.steps}", *TINY, *args.overrides)
    lines = dppo("replay", str(run), "--out", str(replayed), "trainer.record_samples=true").strip().splitlines()[-3:]
    same = total = 0
    logp_diff = 0.0
    for path in sorted((run / "samples").glob("*.npz")):
        theirs, ours = read_samples(path), read_samples(replayed / "samples" / path.name)
        for a, b in zip(theirs, ours, strict=True):
            total += 1
            if a.responses.shape == b.responses.shape and torch.equal(a.responses, b.responses):
                same += 1
                logp_diff = max(logp_diff, float((a.behav_logp - b.behav_logp).abs().max()))
    weights = [load_file(d / "hf_model" / "model.safetensors") for d in (run, replayed)]
    weight_diff = max(float((weights[0][k].double() - weights[1][k].double()).abs().max()) for k in weights[0])
    result = {
        "steps": args.steps,
        "groups": total,
        "groups_token_identical": same,
        "behav_logp_max_abs_diff_on_identical": logp_diff,
        "final_weights_max_abs_diff": weight_diff,
        "replay_lines": [line.strip() for line in lines],
    }
    (args.out / "replay_vllm.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
