"""benchmarks/rollout_bench.py's ceiling: the matmul FLOPs of a token's forward pass, counted by hand for a Qwen2
shape, and the matmul rate it is divided into. (The bench itself needs .venv-vllm and minutes.)"""

from __future__ import annotations

import pytest
from bench_scripts import load_bench  # tests/bench_scripts.py (tests/conftest.py puts tests/ on sys.path)
from transformers import Qwen2Config, Qwen2ForCausalLM


@pytest.fixture(scope="module")
def bench():
    yield from load_bench("rollout_bench")


@pytest.mark.parametrize("tied", [False, True])
def test_a_forward_pass_counts_every_projection_and_the_lm_head_once(bench, tied):
    hidden, inter, layers, heads, kv_heads, vocab = 64, 96, 3, 4, 2, 50
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=tied,
    )
    head_dim = hidden // heads
    per_layer = hidden * hidden * 2 + hidden * kv_heads * head_dim * 2 + 3 * hidden * inter  # q, o; k, v; MLP
    assert bench.forward_flops(Qwen2ForCausalLM(config)) == 2 * (layers * per_layer + hidden * vocab)


def test_the_matmul_ceiling_times_a_decode_step_through_the_models_own_layers(bench, monkeypatch):
    model, timed = bench._model("tiny"), []
    real = bench._best_rate

    def best_rate(matmul, flops, repeats):
        timed.append(flops)
        return real(matmul, flops, repeats)

    monkeypatch.setattr(bench, "_best_rate", best_rate)
    best, rates = bench.matmul_ceiling(model, rows=8, dtype="float32", repeats=2)
    assert "torch" in rates and best == max(rates.values()) > 0
    # each kernel's pass is one decode step of 8 rows: 8 token-forwards' matmuls, what the ceiling divides by
    assert timed and all(flops == 8 * bench.forward_flops(model) for flops in timed)
