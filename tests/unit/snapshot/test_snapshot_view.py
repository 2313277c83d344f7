"""view(k): the slot's tensors in place, for torch.func.functional_call, leaving the live weights alone."""

from __future__ import annotations

import torch
from torch.func import functional_call

from dppo.snapshot import SnapshotPool


def test_functional_call_over_a_view_equals_the_saved_models_output_bitwise(tiny_lm, perturb, state, assert_bitwise):
    model = tiny_lm()
    tokens = torch.randint(0, 37, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(tokens)
    pool = SnapshotPool(model)
    pool.save(0)
    pool.fence()
    perturb(model)
    live = state(model)
    with torch.no_grad():
        out = functional_call(model, pool.view(0), (tokens,))
        assert not torch.equal(model(tokens), expected)
    assert torch.equal(out, expected)
    assert_bitwise(state(model), live)  # live weights untouched


def test_views_alias_the_slot_memory_and_are_contiguous(tiny_lm):
    model = tiny_lm()
    pool = SnapshotPool(model)
    pool.save(0)
    views = pool.view(0)
    assert list(views) == pool.names
    for name, p in model.named_parameters(remove_duplicate=False):
        v = views[name]
        assert v.shape == p.shape and v.dtype == p.dtype and v.device.type == "cpu" and v.is_contiguous()
        assert v.data_ptr() != p.data_ptr() and not v.requires_grad
    again = pool.view(0)
    assert all(again[k].data_ptr() == views[k].data_ptr() for k in views)  # no copy: the same memory
    views["layers.0.1.bias"].fill_(7.0)  # writing through a view changes the slot
    pool.restore(0)
    assert torch.all(model.layers[0][1].bias == 7.0)


def test_view_offsets_are_aligned(tiny_lm):
    model = tiny_lm()
    pool = SnapshotPool(model)
    pool.save(0)
    for name, v in pool.view(0).items():
        live = dict(model.named_parameters(remove_duplicate=False))[name]
        assert v.data_ptr() % 256 == live.data_ptr() % 256, name


def test_view_with_checksum_verifies_and_views_see_later_corruption_only_through_the_check(tiny_lm):
    model = tiny_lm()
    pool = SnapshotPool(model, checksum=True)
    pool.save(1)
    views = pool.view(1)  # verified
    views["embed.weight"].zero_()
    pool.save(1)  # views alive: copy on write, new checksum over fresh bytes
    pool.restore(1)
    assert not torch.all(model.embed.weight == 0)
