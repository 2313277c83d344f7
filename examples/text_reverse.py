"""A text run with no downloads: a tiny Qwen2-style model, a byte-level BPE tokenizer trained here, verl-format
parquet files and a reward function, then the `dppo train` command that learns the task.

    python examples/text_reverse.py [OUT_DIR]     # writes OUT_DIR/model, OUT_DIR/data; prints the command

The task: the chat prompt "reverse 407" asks for the digits reversed, "704". Prompts have 2 to 5 digits, so
they differ in length and the run exercises left padding, the chat template and the tokenizer's EOS
(<|im_end|>) like any chat model would. The reward (examples/text_reverse_reward.py) gives partial credit per
character; its data sources reverse_short (2-3 digits) and reverse_long (4-5) are scored apart in val/score/*.

The tokenizer is what transformers' Qwen2 class expects: a byte-level BPE with Qwen2's pre-tokenizer (one token
per digit), trained on the task's own text (so its alphabet is the characters that occur, not all 256 bytes),
saved with a chat template through save_pretrained next to the model's config; AutoTokenizer loads it back
as the Qwen2 tokenizer.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import numpy as np

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2's pre-tokenizer pattern: letters in words, every digit on its own, punctuation, whitespace.
PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
DATA_SOURCES = {"reverse_short": (2, 3), "reverse_long": (4, 5)}  # data_source -> digit counts of its prompts
REWARD_FILE = Path(__file__).resolve().parent / "text_reverse_reward.py"


def make_rows(rng: np.random.Generator, num: int, split: str) -> list[dict]:
    """num verl-format rows: prompt (chat messages), data_source, reward_model.ground_truth, extra_info."""
    rows = []
    sources = list(DATA_SOURCES)
    for index in range(num):
        source = sources[index % len(sources)]
        digits = "".join(rng.integers(0, 10, size=rng.choice(DATA_SOURCES[source])).astype(str))
        rows.append({
            "prompt": [{"role": "user", "content": f"reverse {digits}"}],
            "data_source": source,
            "reward_model": {"style": "rule", "ground_truth": digits[::-1]},
            "extra_info": {"split": split, "index": index},
        })  # fmt: skip
    return rows


def train_tokenizer(texts: list[str], vocab_size: int = 64):
    """A byte-level BPE with Qwen2's pre-tokenizer trained on texts, as transformers' Qwen2 tokenizer class."""
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False)
    )
    tokenizer = transformers.Qwen2TokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None, bos_token=None
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model_dir(
    path: Path,
    texts: list[str],
    seed: int = 0,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    intermediate_size: int = 128,
) -> Path:
    """A randomly initialised tiny Qwen2 and its tokenizer (trained on texts), saved to path with save_pretrained."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = train_tokenizer(texts)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_attention_heads,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def build(out_dir: str | Path, num_train: int = 4096, num_val: int = 128, seed: int = 0) -> dict[str, Path]:
    """Writes out_dir/model (model + tokenizer) and out_dir/data/{train,val}.parquet; returns their paths."""
    out_dir = Path(out_dir)
    rng = np.random.default_rng(seed)
    train, val = make_rows(rng, num_train, "train"), make_rows(rng, num_val, "val")
    # the tokenizer learns its merges from the text of chat-formatted conversations (special tokens aside)
    texts = [f"user\n{r['prompt'][0]['content']}\nassistant\n{r['reward_model']['ground_truth']}\n" for r in train]
    return {
        "model": build_model_dir(out_dir / "model", texts, seed),
        "train": write_parquet(out_dir / "data" / "train.parquet", train),
        "val": write_parquet(out_dir / "data" / "val.parquet", val),
        "reward": REWARD_FILE,
    }


def train_overrides(paths: dict[str, Path], output_dir: str | Path) -> list[str]:
    """The `dppo train` key=value overrides of the example run."""
    return [
        f"model.path={paths['model']}",
        f"data.train_files={paths['train']}",
        f"data.val_files={paths['val']}",
        "data.max_prompt_length=32",
        "data.max_response_length=6",
        f"custom_reward_function.path={paths['reward']}",
        "trainer.total_steps=70",
        "trainer.train_batch_size=64",
        "trainer.parameter_sync_step=2",
        "trainer.test_freq=10",
        "actor.lr=0.005",
        f"trainer.output_dir={output_dir}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default="outputs/text_reverse", help="where the model and data go")
    args = parser.parse_args(argv)
    paths = build(args.out_dir)
    overrides = train_overrides(paths, Path(args.out_dir) / "run")
    print(f"model and tokenizer: {paths['model']}\ndata: {paths['train']}, {paths['val']}\n\nnow train:\n")
    print("  dppo train " + " \\\n    ".join(shlex.quote(part) for part in overrides))
    return 0


if __name__ == "__main__":
    sys.exit(main())
