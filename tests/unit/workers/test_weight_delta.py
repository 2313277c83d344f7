"""The trainer-side weight delta (rollout.weight_sync=delta): what it holds, what applying it gives, its bytes."""

import pytest
import torch

from dppo.workers.weight_delta import apply_delta, bits, weight_delta


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(64, 32, generator=g),
        "b.weight": torch.randn(128, generator=g),
        "c.bias": torch.randn(16, generator=g),
    }


def test_base_plus_delta_is_bitwise_the_new_weights_in_the_engine_dtype_over_three_publishes():
    new = _weights(0)
    held = {name: t.to(torch.bfloat16) for name, t in new.items()}  # what an engine holds after the first load
    for step in range(3):
        base = {name: t.clone() for name, t in new.items()}  # the last publish (fp32, as the object store has it)
        new["a.weight"] = new["a.weight"] + 1e-4 * torch.randn(64, 32)  # mostly rounds away in bf16
        new["a.weight"][step, :] += 1.0  # one row surely changes
        new["c.bias"] = new["c.bias"] + 1.0  # every element changes: sent dense
        delta = weight_delta(base, new, torch.bfloat16, f"p{step}", f"p{step + 1}")
        assert sorted(delta.tensors) == ["a.weight", "c.bias"]  # b unchanged: not sent
        sparse, dense = delta.tensors["a.weight"], delta.tensors["c.bias"]
        assert sparse.index is not None and sparse.index.dtype == torch.int32 and 32 <= sparse.changed < 64 * 32
        assert dense.index is None and dense.values.shape == (16,) and dense.changed == 16
        assert delta.nbytes == sparse.changed * (4 + 2) + 16 * 2
        assert delta.changed_fraction == (sparse.changed + 16) / (64 * 32 + 128 + 16)
        assert apply_delta(held, delta) == ["a.weight", "c.bias"]
        for name, t in new.items():
            assert torch.equal(bits(held[name]), bits(t.to(torch.bfloat16))), name


def test_signed_zero_counts_as_a_change_and_unchanged_weights_give_an_empty_delta():
    base = {"w": torch.zeros(8)}
    assert weight_delta(base, {"w": torch.zeros(8)}, torch.float32, "a", "b").tensors == {}
    new = {"w": torch.tensor([0.0, -0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])}
    delta = weight_delta(base, new, torch.float32, "a", "b")
    assert delta.tensors["w"].index.tolist() == [1] and delta.nbytes == 4 + 4
    held = {"w": torch.zeros(8)}
    apply_delta(held, delta)
    assert torch.equal(bits(held["w"]), bits(new["w"]))


def test_a_dense_update_does_not_alias_the_live_weights():
    live = torch.ones(4)
    delta = weight_delta({"w": torch.zeros(4)}, {"w": live}, torch.float32, "a", "b")
    live.add_(1.0)  # the next optimizer step, after the publish
    assert delta.tensors["w"].values.tolist() == [1.0] * 4


def test_mismatched_tensors_or_dtypes_are_refused():
    with pytest.raises(ValueError, match="only in the new: \\['x'\\]"):
        weight_delta({"w": torch.zeros(2)}, {"w": torch.ones(2), "x": torch.ones(2)}, torch.float32, "a", "b")
    delta = weight_delta({"w": torch.zeros(2)}, {"w": torch.ones(2)}, torch.bfloat16, "a", "b")
    with pytest.raises(TypeError, match="bfloat16"):
        apply_delta({"w": torch.zeros(2)}, delta)
