"""Delta weight sync's bookkeeping (no vLLM needed): the held copy, the bytes, the fused layers reloaded."""

import torch

from dppo.workers.rollout.engines.delta import DeltaTracker, reload_groups
from dppo.workers.weight_delta import bits


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 32, generator=g), "b.weight": torch.randn(128, generator=g)}


def test_the_held_copy_is_bitwise_the_new_weights_in_the_engine_dtype_after_each_sync():
    tracker, weights = DeltaTracker(), _weights(0)
    first = tracker.apply(weights, torch.bfloat16)
    held = tracker.weights["a.weight"]
    assert first.changed_fraction == 1.0 and first.bytes == (64 * 32 + 128) * 2
    for step in range(3):
        weights["a.weight"] = weights["a.weight"] + 1e-4 * torch.randn(64, 32)  # mostly rounds away in bf16
        weights["a.weight"][step, :] += 1.0  # one row surely changes
        update = tracker.apply(weights, torch.bfloat16)
        assert update.changed_names == ["a.weight"]  # b unchanged: not sent
        for name, t in weights.items():
            assert torch.equal(bits(tracker.weights[name]), bits(t.to(torch.bfloat16)))
        assert tracker.weights["a.weight"] is held  # updated in place, never replaced
        assert 32 / (64 * 32 + 128) <= update.changed_fraction < 1
        assert update.bytes == round(update.changed_fraction * (64 * 32 + 128)) * (4 + 2)


def test_signed_zero_counts_as_a_change():
    tracker = DeltaTracker()
    tracker.apply({"w": torch.zeros(4)}, torch.float32)
    update = tracker.apply({"w": torch.tensor([0.0, -0.0, 0.0, 0.0])}, torch.float32)
    assert update.changed_names == ["w"] and update.bytes == 4 + 4
    assert torch.equal(bits(tracker.weights["w"]), bits(torch.tensor([0.0, -0.0, 0.0, 0.0])))


def test_a_fused_layer_is_reloaded_whole():
    names = [
        "m.l0.attn.q_proj.weight",
        "m.l0.attn.q_proj.bias",
        "m.l0.attn.k_proj.weight",
        "m.l0.attn.v_proj.weight",
        "m.l0.attn.o_proj.weight",
        "m.l1.attn.q_proj.weight",
        "m.l1.attn.k_proj.weight",
        "m.l1.attn.v_proj.weight",
    ]
    weights = {name: torch.zeros(1) for name in names}
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    chosen = reload_groups(weights, ["m.l0.attn.k_proj.weight"], packed)
    assert sorted(chosen) == sorted(names[:4])  # layer 0's q, k, v (and q's bias); not o_proj, not layer 1
    assert sorted(reload_groups(weights, ["m.l0.attn.o_proj.weight"], packed)) == ["m.l0.attn.o_proj.weight"]


def test_a_tied_tensor_is_held_once_and_reloaded_under_both_names():
    g = torch.Generator().manual_seed(3)
    embed = torch.randn(16, 8, generator=g)
    weights = {"embed.weight": embed, "b.weight": torch.randn(8, generator=g), "lm_head.weight": embed}
    tracker = DeltaTracker()
    first = tracker.apply(weights, torch.bfloat16)
    assert tracker.weights["lm_head.weight"] is tracker.weights["embed.weight"]  # one copy, not two
    assert first.bytes == (16 * 8 + 8) * 2 and sorted(first.changed_names) == sorted(weights)
    embed[2, :] += 1.0  # the tied tensor changes (both names see it)
    update = tracker.apply(weights, torch.bfloat16)
    assert sorted(update.changed_names) == ["embed.weight", "lm_head.weight"]  # the engine reloads both
    assert update.bytes == 8 * (4 + 2) and update.changed_fraction == 8 / (16 * 8 + 8)  # counted once
    for name, t in weights.items():
        assert torch.equal(bits(tracker.weights[name]), bits(t.to(torch.bfloat16)))
    untied = DeltaTracker()
    untied.apply({**weights, "lm_head.weight": embed.clone()}, torch.bfloat16)  # equal values, own memory: two
    assert untied.weights["lm_head.weight"] is not untied.weights["embed.weight"]


def test_a_moe_layers_experts_are_reloaded_whole_in_either_checkpoint_layout():
    """vLLM stacks all experts of a layer into one layer (w13, w2), which packed_modules_mapping does not describe:
    one changed expert tensor, stacked (transformers 5) or per expert (older checkpoints), reloads every expert
    tensor of that layer, and nothing of the router, the shared expert or another layer."""
    names = [
        "m.l0.mlp.gate.weight",
        "m.l0.mlp.experts.0.gate_proj.weight",
        "m.l0.mlp.experts.0.up_proj.weight",
        "m.l0.mlp.experts.0.down_proj.weight",
        "m.l0.mlp.experts.1.gate_proj.weight",
        "m.l0.mlp.experts.1.down_proj.weight",
        "m.l0.mlp.shared_expert.gate_proj.weight",
        "m.l1.mlp.experts.0.down_proj.weight",
        "m.l1.mlp.experts.gate_up_proj",
        "m.l1.mlp.experts.down_proj",
    ]
    weights = {name: torch.zeros(1) for name in names}
    packed = {"gate_up_proj": ["gate_proj", "up_proj"]}
    assert sorted(reload_groups(weights, ["m.l0.mlp.experts.1.down_proj.weight"], packed)) == sorted(names[1:6])
    assert sorted(reload_groups(weights, ["m.l1.mlp.experts.gate_up_proj"], packed)) == sorted(names[7:])
    assert sorted(reload_groups(weights, ["m.l0.mlp.gate.weight"], packed)) == ["m.l0.mlp.gate.weight"]
    shared = reload_groups(weights, ["m.l0.mlp.shared_expert.gate_proj.weight"], packed)
    assert sorted(shared) == ["m.l0.mlp.shared_expert.gate_proj.weight"]  # its own gate_up_proj (up_proj not here)
