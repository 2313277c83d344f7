"""Weights as the object store carries them (dppo.models.SharedWeights): a tied tensor once, no pickled copy, and a
model loaded from them holds the same weights with its tie intact."""

import pickle

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from dppo.models import SharedWeights, tied_aliases


def tied_model(dtype=torch.float32) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=300,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(config).to(dtype)


def out_of_band_bytes(obj) -> tuple[bytes, int, list]:
    """Pickle obj as Ray does (protocol 5, buffers out of band): (the in-band pickle, the out-of-band bytes, the buffers)."""
    buffers = []
    data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return data, sum(memoryview(b).nbytes for b in buffers), buffers


def unique_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() yields a tied one once


def test_a_tied_model_names_its_alias():
    model = tied_model()
    assert tied_aliases(model) == {"lm_head.weight": "model.embed_tokens.weight"}
    untied = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=300,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            tie_word_embeddings=False,
        )
    )
    assert tied_aliases(untied) == {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_published_weights_hold_the_tied_tensor_once_and_out_of_band(dtype):
    model = tied_model(dtype)
    shared = SharedWeights.of(model.state_dict(), tied_aliases(model))
    assert "lm_head.weight" not in shared.arrays
    assert shared.nbytes == unique_bytes(model)
    in_band, out_of_band, _ = out_of_band_bytes(shared)
    assert out_of_band == unique_bytes(model)  # every tensor's bytes go to the store as they are, once
    assert len(in_band) < 20_000  # names and dtypes only: no pickled copy of the weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_loaded_from_them_has_the_same_weights_and_keeps_its_tie(dtype):
    source, target = tied_model(dtype), tied_model(dtype)
    torch.nn.init.normal_(target.model.embed_tokens.weight)  # differs from source's
    in_band, _, buffers = out_of_band_bytes(SharedWeights.of(source.state_dict(), tied_aliases(source)))
    received = pickle.loads(in_band, buffers=buffers)  # what a worker's ray.get returns: views of the buffers
    target.load_state_dict(received.state_dict())  # strict: every key, the alias included
    for name, t in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], t), name
    assert target.lm_head.weight is target.model.embed_tokens.weight
    assert target.model.embed_tokens.weight.dtype == dtype
