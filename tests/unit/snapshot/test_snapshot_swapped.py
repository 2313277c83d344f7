"""swapped(k): live weights hold slot k inside the block and come back bitwise on exit, even on error."""

from __future__ import annotations

import pytest
import torch

from dppo.snapshot import EmptySlotError, SnapshotError, SnapshotPool


@pytest.fixture
def two_states(tiny_lm, perturb, state):
    model = tiny_lm()
    pool = SnapshotPool(model)
    old = state(model)
    pool.save(0)
    pool.fence()
    perturb(model)
    return model, pool, old, state(model)


def test_inside_the_block_the_live_weights_hold_the_slot(two_states, state, assert_bitwise):
    model, pool, old, live = two_states
    tokens = torch.randint(0, 37, (2, 5))
    with pool.swapped(0) as same:
        assert same is pool
        assert_bitwise(state(model), old)
        model(tokens).sum().backward()  # a real forward/backward on the swapped weights
    assert_bitwise(state(model), live)
    assert_bitwise(pool.view(0), old)  # the slot itself is unchanged


def test_exception_inside_the_block_still_restores_the_live_weights(two_states, state, assert_bitwise):
    model, pool, old, live = two_states
    with pytest.raises(ZeroDivisionError):
        with pool.swapped(0):
            assert_bitwise(state(model), old)
            1 / 0
    assert_bitwise(state(model), live)
    with pool.swapped(0):  # and the pool is usable again
        assert_bitwise(state(model), old)
    assert_bitwise(state(model), live)


def test_writes_inside_the_block_are_discarded_on_exit(two_states, state, assert_bitwise):
    model, pool, old, live = two_states
    with pool.swapped(0):
        with torch.no_grad():
            model.embed.weight.fill_(3.0)
    assert_bitwise(state(model), live)
    assert_bitwise(pool.view(0), old)


def test_swapped_does_not_nest(two_states, state, assert_bitwise):
    model, pool, old, live = two_states
    pool.save(1)
    with pool.swapped(0):
        with pytest.raises(SnapshotError, match="does not nest"):
            with pool.swapped(1):
                pass
        assert_bitwise(state(model), old)
    assert_bitwise(state(model), live)


def test_empty_slot_leaves_everything_as_it_was(two_states, state, assert_bitwise):
    model, pool, old, live = two_states
    with pytest.raises(EmptySlotError):
        with pool.swapped(4):
            pass
    assert_bitwise(state(model), live)
    with pool.swapped(0):
        pass


def test_clearing_the_swapped_slot_inside_the_block_is_safe(two_states, state, assert_bitwise):
    model, pool, old, live = two_states
    with pool.swapped(0):
        pool.clear(0)
        assert_bitwise(state(model), old)
    assert_bitwise(state(model), live)
    assert pool.slots == []


def test_save_inside_the_block_snapshots_the_swapped_in_weights(two_states, state, assert_bitwise):
    model, pool, old, live = two_states
    with pool.swapped(0):
        pool.save(1)
    assert_bitwise(state(model), live)
    assert_bitwise(pool.view(1), old)


def test_scratch_is_allocated_once_and_reused(two_states):
    _, pool, _, _ = two_states
    with pool.swapped(0):
        pass
    allocs, held = pool.stats()["arena_allocs"], pool.host_bytes
    for _ in range(5):
        with pool.swapped(0):
            pass
    assert pool.stats()["arena_allocs"] == allocs and pool.host_bytes == held


# CPU copy tasks of the pool below, numbered in issue order (_piece_bytes=4096: "w" is 4 tasks, "t" 1):
# save(0) 0-4; entering swapped(0): live -> scratch 5-9, then slot -> live 10-14 (the last one is "t").
@pytest.mark.parametrize("fail_task", [7, 11, 14], ids=["to-scratch", "slot-in", "slot-in-strided"])
def test_a_copy_that_fails_while_entering_leaves_the_live_weights_as_they_were(fail_task, state, assert_bitwise):
    torch.manual_seed(0)
    tensors = {"w": torch.randn(4096), "t": torch.randn(64, 32).t()}
    pool = SnapshotPool(tensors, _piece_bytes=4096, _fail_copy_task=fail_task)
    old = state(tensors)
    pool.save(0)
    pool.synchronize()
    with torch.no_grad():
        for t in tensors.values():
            t.mul_(-3.0)
    live = state(tensors)
    with pytest.raises(SnapshotError, match=f"injected failure of CPU copy task {fail_task} "):
        with pool.swapped(0):
            pytest.fail("the block must not run when entering failed")
    assert_bitwise(state(tensors), live)  # what had come in was copied back from the scratch
    pool.synchronize()  # the failure was raised by swapped(); it is not raised again
    assert_bitwise(pool.view(0), old)
    stats = pool.stats()
    assert pool.slots == [0] and stats["pending_copies"] == 0 and stats["failed_copies"] == 1
    with pool.swapped(0):  # and the pool is usable again
        assert_bitwise(state(tensors), old)
    assert_bitwise(state(tensors), live)
