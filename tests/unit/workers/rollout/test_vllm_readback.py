"""How a vLLM parameter maps back to checkpoint tensors (dppo.workers.rollout.engines.vllm_readback; no vLLM needed):
fused layers sliced at the published sizes, stacked experts renamed, a padded vocabulary cut, and a parameter that
maps to nothing an error rather than a tensor left unchecked."""

import pytest
import torch

from dppo.workers.rollout.engines.vllm_readback import to_checkpoint
from dppo.workers.sync_check import WeightSyncUnverifiableError

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
SHAPES = {
    "m.layers.0.attn.q_proj.weight": (4, 3),
    "m.layers.0.attn.k_proj.weight": (2, 3),
    "m.layers.0.attn.v_proj.weight": (2, 3),
    "m.layers.0.attn.q_proj.bias": (4,),
    "m.layers.0.attn.k_proj.bias": (2,),
    "m.layers.0.attn.v_proj.bias": (2,),
    "m.layers.0.mlp.experts.gate_up_proj": (4, 6, 3),
    "m.layers.0.mlp.experts.down_proj": (4, 3, 3),
    "m.embed_tokens.weight": (5, 3),
}


def test_a_fused_layer_is_sliced_into_its_parts_at_the_published_sizes():
    qkv = torch.arange(24.0).view(8, 3)
    parts = to_checkpoint("m.layers.0.attn.qkv_proj.weight", qkv, SHAPES, PACKED)
    assert list(parts) == [f"m.layers.0.attn.{p}_proj.weight" for p in "qkv"]
    assert torch.equal(torch.cat(list(parts.values())), qkv) and [t.shape[0] for t in parts.values()] == [4, 2, 2]
    bias = to_checkpoint("m.layers.0.attn.qkv_proj.bias", torch.arange(8.0), SHAPES, PACKED)
    assert torch.equal(bias["m.layers.0.attn.k_proj.bias"], torch.tensor([4.0, 5.0]))
    wrong = to_checkpoint("m.layers.0.attn.qkv_proj.weight", torch.zeros(9, 3), SHAPES, PACKED)
    assert list(wrong) == ["m.layers.0.attn.q_proj.weight"]  # whole, under its first part: its shape then differs


def test_stacked_experts_are_transformers_stacked_experts_and_a_padded_vocabulary_is_cut():
    w13 = torch.randn(4, 6, 3)
    for name in ("m.layers.0.mlp.experts.routed_experts.w13_weight", "m.layers.0.mlp.experts.w13_weight"):
        assert to_checkpoint(name, w13, SHAPES, PACKED) == {"m.layers.0.mlp.experts.gate_up_proj": w13}
    w2 = to_checkpoint("m.layers.0.mlp.experts.routed_experts.w2_weight", torch.randn(4, 3, 3), SHAPES, PACKED)
    assert list(w2) == ["m.layers.0.mlp.experts.down_proj"]
    padded = torch.randn(8, 3)  # vLLM pads the vocabulary to a multiple of its own
    assert torch.equal(
        to_checkpoint("m.embed_tokens.weight", padded, SHAPES, PACKED)["m.embed_tokens.weight"], padded[:5]
    )


def test_a_parameter_that_maps_to_no_published_tensor_is_an_error_naming_it():
    with pytest.raises(WeightSyncUnverifiableError, match=r"parameter m.layers.0.mlp.experts.w_scale maps to no"):
        to_checkpoint("m.layers.0.mlp.experts.w_scale", torch.zeros(1), SHAPES, PACKED)
