"""The text task of issue 18's point 3: a ~40M Qwen2 with 64-token responses, where generation dominates.

    python benchmarks/text_peer_task.py OUT_DIR [--seed S]   # writes OUT_DIR/model, OUT_DIR/data; prints the command

The chat prompt "repeat 7" asks for the digit 64 times; benchmarks/text_peer_reward.py scores the share of the
64 positions that hold it. The model starts from a short supervised warm-up (WARMUP_STEPS AdamW steps on
answers of 64 uniformly random digits), so it answers every prompt with digits and no end token: the reward
starts at 1/10, and reinforcement learning must teach it to answer each prompt with its own digit. Every
response of the run is 64 tokens long: the rollout generates 64 tokens per sample and the trainer trains on 64.
(From random weights, RL alone went nowhere in 15-20 steps here: responses of junk tokens, reward 0.01-0.03,
or a collapse to one token at lr 3e-4.)

The tokenizer, the chat template and the model class are those of the text example (examples/text_reverse.py:
a byte-level BPE with Qwen2's pre-tokenizer, one token per digit); the model is the 42m shape of
benchmarks/rollout_bench.py (512 hidden, 10 layers, 8 heads, 2048 intermediate: 43M parameters with this
vocabulary, every one of them trained).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from examples.text_reverse import build_model_dir, write_parquet  # noqa: E402

REWARD_FILE = Path(__file__).resolve().parent / "text_peer_reward.py"
SHAPE = {"hidden_size": 512, "num_hidden_layers": 10, "num_attention_heads": 8, "intermediate_size": 2048}
RESPONSE_TOKENS = 64
DATA_SOURCE = "repeat_digit"
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
WARMUP_STEPS, WARMUP_BATCH, WARMUP_LR = 20, 16, 1e-3


def make_rows(rng: np.random.Generator, num: int, split: str) -> list[dict]:
    """num verl-format rows, the digit of each drawn uniformly."""
    return [
        {
            "prompt": [{"role": "user", "content": f"repeat {d}"}],
            "data_source": DATA_SOURCE,
            "reward_model": {"style": "rule", "ground_truth": str(d)},
            "extra_info": {"split": split, "index": i},
        }
        for i, d in enumerate(rng.integers(0, 10, size=num))
    ]


def set_chat_template(model_dir: Path) -> None:
    """The task's chat template: the user's text as the whole prompt, so the prompt ends in its digit."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(model_dir)


def warm_up(model_dir: Path, seed: int, steps: int = WARMUP_STEPS) -> None:
    """Supervised steps on "repeat d" -> 64 uniformly random digits (loss on the answer only), saved in place."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"repeat {d}"}], add_generation_prompt=True, tokenize=False
        )
        for d in range(10)
    ]
    prompt_ids = torch.tensor([tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts])
    digit_ids = torch.tensor(tokenizer.convert_tokens_to_ids([str(d) for d in range(10)]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=WARMUP_LR, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        which = torch.randint(0, 10, (WARMUP_BATCH,), generator=generator)
        answers = digit_ids[torch.randint(0, 10, (WARMUP_BATCH, RESPONSE_TOKENS), generator=generator)]
        ids = torch.cat([prompt_ids[which], answers], dim=1)
        labels = ids.clone()
        labels[:, : prompt_ids.shape[1]] = -100
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(model_dir)


def build(out_dir: str | Path, seed: int = 0, num_train: int = 4096, num_val: int = 64) -> dict[str, Path]:
    """Writes out_dir/model (the 43M model, random weights of seed, and its tokenizer) and out_dir/data."""
    out_dir = Path(out_dir)
    rng = np.random.default_rng(seed)
    train, val = make_rows(rng, num_train, "train"), make_rows(rng, num_val, "val")
    texts = [f"repeat {d}{str(d) * RESPONSE_TOKENS}" for d in range(10)]
    model = build_model_dir(out_dir / "model", texts, seed, **SHAPE)
    set_chat_template(model)
    warm_up(model, seed)
    return {
        "model": model,
        "train": write_parquet(out_dir / "data" / "train.parquet", train),
        "val": write_parquet(out_dir / "data" / "val.parquet", val),
        "reward": REWARD_FILE,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    paths = build(args.out_dir, args.seed)
    print(" ".join(shlex.quote(f"{k}={v}") for k, v in paths.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
