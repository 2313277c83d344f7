"""Bitwise round trips through SnapshotPool on the CPU: dtypes, odd sizes, strides, ties, overwrites."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dppo.snapshot import SnapshotPool

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.bool,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.complex64,
]
SIZES = [0, 1, 3, 255, 257, 1023, (1 << 20) + 7]


def _random(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=gen, dtype=dtype)


def _scramble(tensors) -> None:
    with torch.no_grad():
        for t in tensors:
            t.copy_(~t if t.dtype == torch.bool else t + 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_and_odd_size_round_trips(dtype, state, assert_bitwise):
    gen = torch.Generator().manual_seed(1)
    tensors = {f"t{n}": _random((n,), dtype, gen) for n in SIZES}
    expected = state(tensors)
    pool = SnapshotPool(tensors)
    pool.save(0)
    pool.synchronize()
    _scramble([t for t in tensors.values() if t.numel()])
    pool.restore(0)
    assert_bitwise(tensors, expected)
    assert_bitwise(pool.view(0), expected)
    assert pool.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())


def test_special_float_values_round_trip_bitwise(state, assert_bitwise):
    x = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-45, -1e38])
    tensors = {"x": x, "h": x.to(torch.float16), "b": x.to(torch.bfloat16)}
    expected = state(tensors)
    pool = SnapshotPool(tensors)
    pool.save(3)
    pool.fence()  # the save may still be copying: writers of the live tensors fence first
    _scramble(tensors.values())
    pool.restore(3)
    assert_bitwise(tensors, expected)


def test_non_contiguous_tensors_round_trip_bitwise(state, assert_bitwise):
    base = torch.randn(16, 24)
    tensors = {
        "transposed": torch.randn(40, 30).t(),
        "strided": torch.randn(50, 64)[::3, 1::2],
        "channels_last": torch.randn(2, 3, 5, 7).to(memory_format=torch.channels_last),
        "column": base[:, 5],
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "int_t": torch.arange(60, dtype=torch.int64).reshape(6, 10).t(),
    }
    assert not tensors["transposed"].is_contiguous() and not tensors["channels_last"].is_contiguous()
    expected = state(tensors)
    strides = {k: t.stride() for k, t in tensors.items()}
    pool = SnapshotPool(tensors)
    pool.save(0)
    pool.fence()
    _scramble(tensors.values())
    pool.restore(0)
    assert_bitwise(tensors, expected)
    assert {k: t.stride() for k, t in tensors.items()} == strides  # restored in place, layout kept
    views = pool.view(0)
    assert_bitwise(views, expected)
    assert all(v.is_contiguous() for v in views.values())


def test_tied_parameters_are_stored_once_and_restored_under_every_name(tiny_lm, state, assert_bitwise, perturb):
    model = tiny_lm(tie=True)
    untied = tiny_lm(tie=False)
    assert model.head.weight is model.embed.weight
    expected = state(model)
    pool = SnapshotPool(model)
    pool_untied = SnapshotPool(untied)
    assert pool.nbytes == pool_untied.nbytes - model.embed.weight.numel() * 4
    assert "head.weight" in pool.names and "embed.weight" in pool.names
    pool.save(0)
    pool.fence()
    perturb(model)
    pool.restore(0)
    assert_bitwise(state(model), expected)
    views = pool.view(0)
    assert views["head.weight"] is views["embed.weight"]


def test_mapping_holding_one_tensor_twice_stores_it_once(state, assert_bitwise):
    w = torch.randn(64, 32)
    tensors = {"a": w, "b": w, "c": torch.randn(10)}
    pool = SnapshotPool(tensors)
    assert pool.nbytes == (64 * 32 + 10) * 4
    expected = state(tensors)
    pool.save(0)
    pool.fence()
    _scramble([w, tensors["c"]])
    pool.restore(0)
    assert_bitwise(tensors, expected)
    views = pool.view(0)
    assert views["a"] is views["b"]
    assert_bitwise(views, expected)


def test_tensors_adjacent_in_memory_round_trip_and_view_correctly(state, assert_bitwise):
    flat = torch.randn(10_000)
    tensors = {"a": flat[:3000].view(30, 100), "b": flat[3000:3001], "c": flat[3001:].view(-1), "d": torch.randn(7)}
    expected = state(tensors)
    pool = SnapshotPool(tensors)
    pool.save(0)
    pool.fence()
    _scramble([flat, tensors["d"]])
    pool.restore(0)
    assert_bitwise(tensors, expected)
    assert_bitwise(pool.view(0), expected)


def test_overwrite_replaces_the_snapshot_and_other_slots_are_independent(tiny_lm, state, assert_bitwise, perturb):
    model = tiny_lm()
    pool = SnapshotPool(model)
    first = state(model)
    pool.save(0)
    pool.save(1)
    pool.fence()
    perturb(model)
    second = state(model)
    pool.save(0)  # overwrite
    pool.fence()
    perturb(model)
    pool.restore(0)
    assert_bitwise(state(model), second)
    pool.restore(1)
    assert_bitwise(state(model), first)
    assert pool.slots == [0, 1] and len(pool) == 2 and 0 in pool and 2 not in pool


def test_buffers_are_included_only_when_asked(tiny_lm, state, assert_bitwise):
    model = tiny_lm()
    assert "scale" not in SnapshotPool(model).names
    pool = SnapshotPool(model, include_buffers=True)
    assert "scale" in pool.names
    expected = state(model, buffers=True)
    pool.save(0)
    pool.fence()
    model.scale.fill_(-4.0)
    pool.restore(0)
    assert_bitwise(state(model, buffers=True), expected)


def test_restore_bumps_the_autograd_version_of_live_tensors():
    w = torch.nn.Parameter(torch.randn(8))
    pool = SnapshotPool({"w": w})
    pool.save(0)
    before = w._version
    pool.restore(0)
    assert w._version > before


def test_swapped_bumps_the_autograd_version_on_entering_and_leaving():
    w = torch.nn.Parameter(torch.randn(8))
    pool = SnapshotPool({"w": w})
    pool.save(0)
    before = w._version
    with pool.swapped(0):
        inside = w._version
    assert before < inside < w._version


def _inference_tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    with torch.inference_mode():  # e.g. a rollout model built under inference mode
        return {"w": torch.randn(4096), "t": torch.randn(64, 32).t(), "b": torch.randn(5)}


def test_inference_tensors_round_trip_bitwise_through_restore_and_swapped(state, assert_bitwise):
    tensors = _inference_tensors()
    assert all(t.is_inference() for t in tensors.values())
    pool = SnapshotPool(tensors)
    saved = state(tensors)
    pool.save(0)
    pool.fence()
    with torch.inference_mode():
        for t in tensors.values():
            t.mul_(-3.0)
    live = state(tensors)
    with pool.swapped(0):  # inference tensors have no version counter: nothing to bump
        assert_bitwise(state(tensors), saved)
    assert_bitwise(state(tensors), live)
    with pool.swapped(0):  # and swapped() is usable again
        assert_bitwise(state(tensors), saved)
    assert_bitwise(state(tensors), live)
    pool.restore(0)
    assert_bitwise(state(tensors), saved)
    assert_bitwise(pool.view(0), saved)


def test_verl_style_aliases_behave_like_save_restore_clear(state, assert_bitwise):
    tensors = {"w": torch.randn(100)}
    expected = state(tensors)
    pool = SnapshotPool(tensors)
    pool.save_model_to_cpu(2)
    pool.fence()
    tensors["w"].zero_()
    pool.restore_model_from_cpu(2)
    assert_bitwise(tensors, expected)
    pool.clear_cpu_model(2)
    assert pool.slots == []


@st.composite
def _layouts(draw):
    n = draw(st.integers(1, 6))
    out = []
    for _ in range(n):
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=3)))
        dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8]))
        kind = draw(st.sampled_from(["contiguous", "transposed", "sliced"]))
        out.append((shape, dtype, kind))
    return out


@settings(max_examples=40, deadline=None)
@given(layout=_layouts(), seed=st.integers(0, 2**16))
def test_random_layouts_round_trip_bitwise(layout, seed):
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, (shape, dtype, kind) in enumerate(layout):
        t = _random(shape, dtype, gen)
        if kind == "transposed" and t.dim() >= 2:
            t = _random(shape[::-1], dtype, gen).transpose(0, -1)
        elif kind == "sliced" and t.dim() >= 1:
            t = _random((2 * shape[0] + 1, *shape[1:]), dtype, gen)[1::2]
        tensors[f"t{i}"] = t
    expected = {k: v.clone() for k, v in tensors.items()}
    pool = SnapshotPool(tensors, _piece_bytes=4096)
    pool.save(5)
    pool.fence()
    _scramble(tensors.values())
    pool.restore(5)
    for k, t in tensors.items():
        assert t.shape == expected[k].shape
        dense = torch.empty(t.shape, dtype=t.dtype).copy_(t)
        assert torch.equal(
            dense.reshape(-1).view(torch.uint8),
            torch.empty(t.shape, dtype=t.dtype).copy_(expected[k]).reshape(-1).view(torch.uint8),
        )
