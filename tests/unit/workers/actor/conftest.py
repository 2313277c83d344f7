"""Shared helpers of the overlap tests: tiny models of three architectures, batches, weight states."""

from __future__ import annotations

import copy

import pytest
import torch

VOCAB = 19


def _qwen2():
    from transformers import Qwen2ForCausalLM

    from dppo.models import tiny_model_config

    return Qwen2ForCausalLM(tiny_model_config(VOCAB, 32, 2, 2, 48))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
    )


def _gpt2_tied():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=2,
            n_positions=64,
            bos_token_id=None,
            eos_token_id=None,
            tie_word_embeddings=True,
        )
    )
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


ARCHITECTURES = {"qwen2": _qwen2, "llama": _llama, "gpt2-tied": _gpt2_tied}


def _make_model(arch: str, seed: int = 0) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ARCHITECTURES[arch]()
    model.config.use_cache = False
    return model.eval()


def _perturb(model: torch.nn.Module, scale: float = 0.05) -> None:
    gen = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def _params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The Parameter objects themselves, under every name (tied ones twice)."""
    return dict(model.named_parameters(remove_duplicate=False))


def _values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in _params(model).items()}


def _assert_same_weights(model, params_before, values_before):
    """model holds the same Parameter objects as before, bitwise unchanged, and nothing else."""
    now = _params(model)
    assert now.keys() == params_before.keys()
    for name, p in now.items():
        assert p is params_before[name], f"'{name}' is no longer the model's own Parameter"
        assert torch.equal(p.detach().view(torch.uint8), values_before[name].view(torch.uint8)), f"'{name}' changed"


@pytest.fixture
def make_model():
    return _make_model


@pytest.fixture
def perturb():
    return _perturb


@pytest.fixture
def weights_of():
    """weights_of(model) -> (Parameter objects, clones of their values) for assert_same_weights."""
    return lambda model: (_params(model), _values(model))


@pytest.fixture
def assert_same_weights():
    return _assert_same_weights


@pytest.fixture
def snapshotted(make_model, perturb):
    """snapshotted(arch) -> (model with moved live weights, pool with slot 0, deep copy of slot 0's weights)."""
    from dppo.snapshot import SnapshotPool

    def make(arch: str):
        model = make_model(arch)
        pool = SnapshotPool(model)
        pool.save(0)
        pool.fence()
        anchor = copy.deepcopy(model)  # an independent copy of what slot 0 holds
        perturb(model)
        return model, pool, anchor

    return make


@pytest.fixture
def token_batch():
    def make(rows: int = 5, prompt: int = 4, response: int = 6, seed: int = 0):
        from dppo.batch import TrainBatch

        gen = torch.Generator().manual_seed(seed)
        mask = torch.ones(rows, response, dtype=torch.bool)
        return TrainBatch(
            input_ids=torch.randint(0, VOCAB, (rows, prompt + response), generator=gen),
            response_mask=mask,
            behav_logp=-torch.rand(rows, response, generator=gen),
            scores=torch.rand(rows, generator=gen),
            group_index=torch.arange(rows),
            versions=torch.zeros(rows, dtype=torch.long),
        )

    return make
