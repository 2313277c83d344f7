"""A tokenizer with ids past the model's vocab trains when none of them can reach the model, and is one line before
Ray starts (exit 6) when one can: a prompt's token, the pad or the EOS.

The tokenizer is the real case: saved without <|endoftext|> and loaded through AutoTokenizer as Qwen2's class,
which adds an unused <|endoftext|> (its default unk token) past the vocab the model was built for."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dppo.cli import main


def build_model_dir(path, module) -> int:
    """A tiny Qwen2 and a tokenizer of module's (examples/text_reverse.py) saved without <|endoftext|>, the
    model's vocab_size the tokenizer's length before it is loaded again; returns that vocab_size."""
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(module.PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    bpe.decoder = decoders.ByteLevel()
    texts = [f"user\nreverse {n}\nassistant\n{str(n)[::-1]}\n" for n in range(100, 400)]
    bpe.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=64, special_tokens=["<|im_start|>", "<|im_end|>"], show_progress=False)
    )
    tokenizer = transformers.Qwen2TokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|im_end|>", unk_token=None, bos_token=None
    )
    tokenizer.chat_template = module.CHAT_TEMPLATE
    vocab_size = len(tokenizer)
    tokenizer.save_pretrained(path)
    config_path = path / "tokenizer_config.json"  # saved as a user's tokenizer often is: with no unk_token entry
    config = json.loads(config_path.read_text())
    config.pop("unk_token")
    config_path.write_text(json.dumps(config))
    model_config = transformers.Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    transformers.Qwen2ForCausalLM(model_config).save_pretrained(path)
    return vocab_size


@pytest.fixture(scope="module")
def loose_model(tmp_path_factory, text_example):
    path = tmp_path_factory.mktemp("loose_tokenizer")
    vocab_size = build_model_dir(path, text_example["module"])
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert type(tokenizer).__name__.startswith("Qwen2Tokenizer")
    assert len(tokenizer) == vocab_size + 1 and tokenizer.convert_ids_to_tokens(vocab_size) == "<|endoftext|>"
    return path, vocab_size


def run(text_args, model, capsys, **extra) -> tuple[int, list[str]]:
    code = main(["train", *text_args(**{"model.path": model, "trainer.total_steps": 1, **extra})])
    return code, capsys.readouterr().err.strip().splitlines()


def test_ids_past_the_vocab_that_nothing_uses_are_no_obstacle(text_args, loose_model, capsys):
    code, err = run(text_args, loose_model[0], capsys)
    assert code == 0, err


def test_a_pad_token_past_the_vocab_is_one_line_naming_it_and_both_sizes(text_args, loose_model, capsys):
    path, vocab_size = loose_model
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": "<|endoftext|>"}))
    try:
        code, err = run(text_args, path, capsys)
    finally:
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    assert code == 6 and len(err) == 1, err
    assert err[0] == (
        f"dppo: error: the tokenizer in model.path={str(path)!r} has {vocab_size + 1} tokens and the "
        f"model's vocab_size is {vocab_size}; 1 id(s) the model would be given lie past it: "
        f"'<|endoftext|>' (id {vocab_size}, the pad token)"
    )


def test_a_prompt_holding_a_token_past_the_vocab_is_one_line_naming_its_row(text_args, loose_model, tmp_path, capsys):
    path, vocab_size = loose_model
    rows = pq.read_table(_train_file(text_args)).to_pylist()
    rows[5]["prompt"][0]["content"] = "reverse <|endoftext|>12"
    train = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), train)
    code, err = run(text_args, path, capsys, **{"data.train_files": train})
    assert code == 6 and len(err) == 1, err
    assert err[0].endswith(f"'<|endoftext|>' (id {vocab_size}, the prompt of row 5 of {str(train)!r})")


def _train_file(text_args) -> str:
    return next(arg.split("=", 1)[1] for arg in text_args() if arg.startswith("data.train_files="))
