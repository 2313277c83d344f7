"""A tiny random Llama with SmolLM2-135M-Instruct's architecture, written as a GGUF file as llama.cpp writes one.

    write_tiny_smollm_gguf(path, seed=0) -> path

The shape family of SmolLM2 (llama, tied embeddings: no output.weight; grouped-query attention: fewer key/value
heads than heads; RMSNorm, SwiGLU, rotary positions with base 1e5) at tiny sizes, quantized as the real file is
(token_embd in Q8_0, the linear layers in Q4_1, the norms in F32), so transformers' GGUF loader dequantizes real
blocks. Its tokenizer is in the metadata, as llama.cpp stores one: a byte-level BPE (tokenizer.ggml.model=gpt2)
trained here on a few sentences with `tokenizers`, SmolLM2's three leading control tokens and its chat template.
Nothing is downloaded and the 93 MB real file is never read.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# SmolLM2-135M-Instruct's chat template, as its GGUF stores it (tokenizer.chat_template)
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2 (bos 1, eos 2)

HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE, CONTEXT = 64, 2, 4, 2, 128, 512
_CORPUS = [
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
    "Calculate 12 + 7. The answer is 19. What is 45 - 8? Solve 3 + 4 and give only the final answer.",
    "system user assistant the a an of to is and in it that for on with as was",
] * 4


def tiny_bpe() -> tuple[list[str], list[str]]:
    """(tokens in id order, merges "a b"): a byte-level BPE with SmolLM2's control tokens first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    assert tokens[:3] == SPECIAL_TOKENS and [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    return tokens, [m if isinstance(m, str) else " ".join(m) for m in merges]


def write_tiny_smollm_gguf(path: str | Path, seed: int = 0) -> Path:
    """A random tiny SmolLM2-shaped Llama as a GGUF file at path (see the module docstring)."""
    from gguf import GGMLQuantizationType, GGUFWriter, TokenType
    from gguf.quants import quantize

    tokens, merges = tiny_bpe()
    vocab = len(tokens)
    rng = np.random.default_rng(seed)
    head_dim = HIDDEN // HEADS

    writer = GGUFWriter(str(path), "llama")
    writer.add_name("tiny smollm2")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(vocab)
    writer.add_file_type(3)  # MOSTLY_Q4_1, as the real file
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [TokenType.CONTROL] * len(SPECIAL_TOKENS) + [TokenType.NORMAL] * (vocab - len(SPECIAL_TOKENS))
    )
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(SMOLLM2_CHAT_TEMPLATE)

    def tensor(name: str, shape: tuple[int, ...], qtype=GGMLQuantizationType.F32, scale: float = 0.1) -> None:
        data = (rng.standard_normal(shape) * scale).astype(np.float32)
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)

    q4, q8 = GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0
    tensor("token_embd.weight", (vocab, HIDDEN), q8)  # no output.weight: the lm_head is tied to it
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", (1.0 + rng.standard_normal(HIDDEN) * 0.1).astype(np.float32))
        tensor(f"blk.{i}.attn_q.weight", (HEADS * head_dim, HIDDEN), q4)
        tensor(f"blk.{i}.attn_k.weight", (KV_HEADS * head_dim, HIDDEN), q4)
        tensor(f"blk.{i}.attn_v.weight", (KV_HEADS * head_dim, HIDDEN), q4)
        tensor(f"blk.{i}.attn_output.weight", (HIDDEN, HEADS * head_dim), q4)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", (1.0 + rng.standard_normal(HIDDEN) * 0.1).astype(np.float32))
        tensor(f"blk.{i}.ffn_gate.weight", (INTERMEDIATE, HIDDEN), q4)
        tensor(f"blk.{i}.ffn_up.weight", (INTERMEDIATE, HIDDEN), q4)
        tensor(f"blk.{i}.ffn_down.weight", (HIDDEN, INTERMEDIATE), q4)
    writer.add_tensor("output_norm.weight", (1.0 + rng.standard_normal(HIDDEN) * 0.1).astype(np.float32))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def write_gguf_of_architecture(path: str | Path, architecture: str) -> Path:
    """A valid GGUF file of an architecture transformers has no loader for: its metadata and one F32 tensor."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
