"""Bad input gives a typed error with a clear message, and changes nothing: live tensors, slots,
host memory and stats are asserted whole after every error."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import dppo

from dppo.snapshot import (
    EmptySlotError,
    LayoutMismatchError,
    SnapshotError,
    SnapshotMemoryError,
    SnapshotPool,
    UnknownTensorError,
)


@pytest.fixture
def setup(tiny_lm, state, pool_state):
    """A model with slots 0 and 2 filled (slot 2 differs from the live weights)."""
    model = tiny_lm()
    pool = SnapshotPool(model)
    pool.save(2)
    pool.fence()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1)
    pool.save(0)
    pool.synchronize()
    return model, pool


def _unchanged(model, pool, state, pool_state, assert_bitwise):
    """Returns a checker that asserts the model and pool look exactly as they do now."""
    live, before = state(model), pool_state(pool)

    def check() -> None:
        assert_bitwise(state(model), live)
        after = pool_state(pool)
        assert after.pop("views").keys() == before["views"].keys()
        for k, views in pool_state(pool)["views"].items():
            assert_bitwise(views, before["views"][k])
        assert after == {k: v for k, v in before.items() if k != "views"}

    return check


def test_empty_slot_error_names_the_slot_and_the_filled_slots(setup, state, pool_state, assert_bitwise):
    model, pool = setup
    unchanged = _unchanged(model, pool, state, pool_state, assert_bitwise)
    for op in (
        pool.restore,
        pool.view,
        pool.clear,
        pool.tier,
        lambda k: pool.swapped(k).__enter__(),
        lambda k: pool.streamer(k, [["embed.weight"]]),
    ):
        with pytest.raises(EmptySlotError) as err:
            op(1)
        assert isinstance(err.value, KeyError) and isinstance(err.value, SnapshotError)
        assert "slot 1 is empty" in str(err.value) and "[0, 2]" in str(err.value)
        assert not str(err.value).startswith("'")  # KeyError would quote it
        unchanged()


def test_clear_then_restore_raises_instead_of_silently_doing_nothing(setup, state, pool_state, assert_bitwise):
    model, pool = setup
    pool.clear(2)
    unchanged = _unchanged(model, pool, state, pool_state, assert_bitwise)
    with pytest.raises(EmptySlotError, match=r"slot 2 is empty \(filled slots: \[0\]\)"):
        pool.restore(2)
    unchanged()


@pytest.mark.parametrize("slot", [-1, -100])
def test_negative_slot_is_a_value_error(setup, slot, state, pool_state, assert_bitwise):
    model, pool = setup
    unchanged = _unchanged(model, pool, state, pool_state, assert_bitwise)
    for op in (pool.save, pool.restore, pool.clear, pool.view, pool.tier):
        with pytest.raises(ValueError, match=f"slot must be >= 0, got {slot}"):
            op(slot)
    unchanged()


@pytest.mark.parametrize("slot", [True, 1.0, "0", None, (0,)])
def test_non_int_slot_is_a_type_error(setup, slot, state, pool_state, assert_bitwise):
    model, pool = setup
    unchanged = _unchanged(model, pool, state, pool_state, assert_bitwise)
    for op in (pool.save, pool.restore, pool.clear, pool.view):
        with pytest.raises(TypeError, match="slot must be an int"):
            op(slot)
    unchanged()


def test_numpy_integer_slots_are_accepted(setup):
    model, pool = setup
    pool.restore(np.int64(2))
    assert np.int32(0) in pool


def test_the_cpp_core_rechecks_slots_too(setup):
    _, pool = setup
    with pytest.raises(ValueError, match="slot must be >= 0"):
        pool._core.save(-3)
    with pytest.raises(TypeError):
        pool._core.save("3")


def test_replaced_parameter_is_a_layout_mismatch(setup, state, pool_state, assert_bitwise):
    model, pool = setup
    old = model.layers[0][1].weight
    unchanged = _unchanged(model, pool, state, pool_state, assert_bitwise)
    model.layers[0][1].weight = torch.nn.Parameter(old.detach().clone())
    for op in (pool.save, pool.restore, lambda k: pool.swapped(k).__enter__()):
        with pytest.raises(LayoutMismatchError, match=r"'layers\.0\.1\.weight' was replaced") as err:
            op(0)
        assert isinstance(err.value, ValueError)
    model.layers[0][1].weight = old
    unchanged()


def test_added_parameter_is_a_layout_mismatch(setup, state, pool_state, assert_bitwise):
    model, pool = setup
    unchanged = _unchanged(model, pool, state, pool_state, assert_bitwise)
    model.extra = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(LayoutMismatchError, match=r"\['extra'\] were added"):
        pool.restore(0)
    del model.extra
    unchanged()


@pytest.mark.parametrize(
    "change, what",
    [
        (lambda p: torch.zeros(p.shape[0] + 1, *p.shape[1:]), "changed shape"),
        (lambda p: p.detach().to(torch.float64), "changed dtype"),
        (lambda p: p.detach().clone(), "changed storage"),
        (lambda p: p.detach().t().contiguous().t(), "changed strides"),
    ],
    ids=["shape", "dtype", "storage", "strides"],
)
def test_in_place_change_of_a_parameter_is_caught_in_cpp_before_any_byte_moves(
    setup, change, what, state, pool_state, assert_bitwise
):
    model, pool = setup
    p = model.layers[1][3].weight
    original = p.data
    unchanged = _unchanged(model, pool, state, pool_state, assert_bitwise)
    p.data = change(p)  # same Parameter object: only the C++ check can see this
    for op in (pool.save, pool.restore, lambda k: pool.swapped(k).__enter__()):
        with pytest.raises(LayoutMismatchError, match=rf"'layers\.1\.3\.weight' {what} since the pool was built"):
            op(2)
    p.data = original
    unchanged()


def test_mapping_with_a_replaced_value_is_a_layout_mismatch():
    tensors = {"a": torch.randn(4), "b": torch.randn(5)}
    pool = SnapshotPool(tensors)
    pool.save(0)
    tensors["b"] = torch.randn(5)
    with pytest.raises(LayoutMismatchError, match="'b' was replaced"):
        pool.restore(0)


def test_max_host_bytes_error_gives_bytes_asked_and_available_and_loses_nothing(
    tiny_lm, state, pool_state, assert_bitwise
):
    model = tiny_lm()
    probe = SnapshotPool(model)
    probe.save(0)
    arena = probe.host_bytes
    pool = SnapshotPool(model, max_host_bytes=arena + arena // 2)
    pool.save(0)
    pool.synchronize()
    with torch.no_grad():
        model.embed.weight.add_(1)
    unchanged = _unchanged(model, pool, state, pool_state, assert_bitwise)
    with pytest.raises(SnapshotMemoryError) as err:
        pool.save(1)
    assert isinstance(err.value, MemoryError)
    assert f"needs {arena} bytes but only {arena // 2} are available" in str(err.value)
    unchanged()
    with pytest.raises(SnapshotMemoryError):
        pool.reserve(2)
    unchanged()
    pool.save(0)  # the pool stays usable: overwriting the existing slot needs no new arena
    pool.clear(0)
    pool.save(1)  # and a cleared arena serves a new slot
    assert pool.slots == [1] and pool.host_bytes == arena


def test_bad_constructor_arguments_are_rejected_with_the_value():
    with pytest.raises(TypeError, match="expected an nn.Module or a Mapping"):
        SnapshotPool([torch.zeros(1)])
    with pytest.raises(TypeError, match="'x' is a list"):
        SnapshotPool({"x": [1.0]})
    with pytest.raises(ValueError, match="max_host_bytes must be None or >= 0, got -5"):
        SnapshotPool({"x": torch.zeros(1)}, max_host_bytes=-5)
    with pytest.raises(ValueError, match="device_budget_bytes must be >= 0, got -1"):
        SnapshotPool({"x": torch.zeros(1)}, device_budget_bytes=-1)
    with pytest.raises(ValueError, match="nothing to snapshot"):
        SnapshotPool({})
    with pytest.raises(ValueError, match="'m' is on meta; expected cpu or cuda"):
        SnapshotPool({"x": torch.zeros(1), "m": torch.zeros(1, device="meta")})
    with pytest.raises(ValueError, match="'e' has elements that share memory"):
        SnapshotPool({"e": torch.zeros(1).expand(4)})
    with pytest.raises(ValueError, match="only strided tensors"):
        SnapshotPool({"s": torch.zeros(3, 3).to_sparse()})
    with pytest.raises(TypeError, match=r"max_host_bytes must be None or an int, got float 1\.5"):
        SnapshotPool({"x": torch.zeros(1)}, max_host_bytes=1.5)
    with pytest.raises(TypeError, match=r"device_budget_bytes must be an int, got float 2\.0"):
        SnapshotPool({"x": torch.zeros(1)}, device_budget_bytes=2.0)


@pytest.mark.parametrize(
    "make, flag",
    [
        (lambda: torch.randn(6, dtype=torch.complex64).conj(), "conjugate"),
        (lambda: torch.randn(3, 2, dtype=torch.complex64).conj().t(), "conjugate"),
        (lambda: torch._neg_view(torch.randn(6)), "negative"),
    ],
    ids=["conj", "conj-strided", "neg"],
)
def test_tensors_with_a_conjugate_or_negative_bit_are_rejected_with_their_name(make, flag):
    lazy = make()
    assert lazy.is_conj() or lazy.is_neg()
    with pytest.raises(ValueError, match=rf"tensor 'lazy' has its {flag} bit set .*resolve_(conj|neg)\(\)"):
        SnapshotPool({"ok": torch.zeros(2), "lazy": lazy})
    resolved = lazy.resolve_conj().resolve_neg()  # what the error asks for works, and views read it bitwise
    pool = SnapshotPool({"lazy": resolved})
    pool.save(0)
    assert torch.equal(pool.view(0)["lazy"], lazy)


def test_slots_beyond_int64_are_not_in_the_pool_and_are_value_errors(setup):
    _, pool = setup
    assert 2**63 not in pool and 2**70 not in pool and -(2**63) - 1 not in pool
    assert (2**63 - 1) not in pool
    for op in (pool.save, pool.restore, pool.clear, pool.view):
        with pytest.raises(ValueError, match=rf"slot must be < 2\*\*63, got {2**63}"):
            op(2**63)


_NO_ADDRESS_SPACE = """
import resource, torch
from dppo.snapshot import SnapshotPool, SnapshotMemoryError
pool = SnapshotPool({"w": torch.zeros(16 << 20)})  # a 64 MiB arena
vm_bytes = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm_bytes + (16 << 20), resource.RLIM_INFINITY))
try:
    pool.save(0)
except SnapshotMemoryError as err:
    print(err)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/meminfo are Linux's")
def test_a_failed_arena_allocation_says_how_much_host_memory_is_available():
    root = str(Path(dppo.__file__).resolve().parent.parent)  # the child imports this dppo
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(
        [sys.executable, "-c", _NO_ADDRESS_SPACE], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert re.search(
        r"save\(0\): allocating a host arena of \d+ bytes failed: mmap: .*\(\d+ bytes of host memory "
        r"available\)",
        out.stdout,
    ), out.stdout


def test_streamer_schedule_with_an_unknown_name_names_it(setup):
    _, pool = setup
    with pytest.raises(UnknownTensorError, match="step 1: no tensor named 'nope'") as err:
        pool.streamer(0, [["embed.weight"], ["head.weight", "nope"]])
    assert isinstance(err.value, KeyError)
    assert str(err.value).startswith("streamer schedule")


def test_checksum_mismatch_copies_nothing(tiny_lm, state, pool_state, assert_bitwise):
    model = tiny_lm()
    pool = SnapshotPool(model, checksum=True)
    pool.save(0)
    pool.fence()
    with torch.no_grad():
        model.embed.weight.add_(1)
    pool.view(0)["layers.2.3.bias"][3] += 1  # corrupt the slot behind the pool's back
    live = state(model)
    with pytest.raises(SnapshotError, match=r"restore\(0\): slot 0 fails its checksum: saved 0x[0-9a-f]{16}, now 0x"):
        pool.restore(0)
    with pytest.raises(SnapshotError, match="fails its checksum"):
        pool.swapped(0).__enter__()
    with pytest.raises(SnapshotError, match="fails its checksum"):
        pool.view(0)
    with pytest.raises(SnapshotError, match="fails its checksum"):
        pool.streamer(0, [["embed.weight"]]).begin()
    assert_bitwise(state(model), live)
    pool.save(0)  # a new save records a new checksum
    pool.restore(0)
    assert_bitwise(state(model), live)
