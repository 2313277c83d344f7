"""The async contract on the CPU: save returns at once, writers fence, readers wait for the slot's save.

A testing aid (_copy_delay_s) makes every copy task sleep before it copies, so each race below is
deterministic: without the ordering the engine promises, the assertions would fail.
"""

from __future__ import annotations

import threading
import time

import torch

from dppo.snapshot import SnapshotPool

DELAY_S = 0.25


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(256, 512)  # ~0.5 MiB: one copy task per tensor


def test_save_returns_before_the_copy_finishes(state, assert_bitwise):
    model = _model()
    expected = state(model)
    pool = SnapshotPool(model, _copy_delay_s=DELAY_S)
    t0 = time.perf_counter()
    pool.save(0)
    assert time.perf_counter() - t0 < DELAY_S / 2
    assert pool.stats()["pending_copies"] == 1
    pool.synchronize()
    assert time.perf_counter() - t0 >= DELAY_S
    assert pool.stats()["pending_copies"] == 0
    assert_bitwise(pool.view(0), expected)


def test_a_write_without_fence_races_the_save_which_is_why_fence_exists(state):
    model = _model()
    pool = SnapshotPool(model, _copy_delay_s=DELAY_S)
    before = state(model)
    pool.save(0)
    with torch.no_grad():
        model.weight.add_(1.0)  # contract violation: no fence
    pool.synchronize()
    assert not torch.equal(pool.view(0)["weight"], before["weight"])


def test_fence_orders_a_later_write_after_the_pending_save(state, assert_bitwise):
    model = _model()
    pool = SnapshotPool(model, _copy_delay_s=DELAY_S)
    before = state(model)
    pool.save(0)
    t0 = time.perf_counter()
    pool.fence()
    assert time.perf_counter() - t0 >= DELAY_S / 2
    with torch.no_grad():
        model.weight.add_(1.0)
    assert_bitwise(pool.view(0), before)


def test_guard_makes_an_optimizer_step_after_an_async_save_safe(state, assert_bitwise):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.randn(4, 256)).square().sum().backward()
    pool = SnapshotPool(model, _copy_delay_s=DELAY_S)
    handle = pool.guard(opt)
    assert pool.guard(opt) is handle  # idempotent per optimizer
    assert len(opt._optimizer_step_pre_hooks) == 1
    before = state(model)
    pool.save(0)
    opt.step()
    assert not torch.equal(model.weight, before["weight"])  # the step happened...
    assert_bitwise(pool.view(0), before)  # ...after the snapshot was taken
    handle.remove()
    assert len(opt._optimizer_step_pre_hooks) == 0


def test_guard_after_the_hook_was_removed_registers_a_new_one(state, assert_bitwise):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.randn(4, 256)).square().sum().backward()
    pool = SnapshotPool(model, _copy_delay_s=DELAY_S)
    first = pool.guard(opt)
    first.remove()
    assert len(opt._optimizer_step_pre_hooks) == 0
    second = pool.guard(opt)  # the removed handle is dead: a new hook, not the old handle
    assert second is not first
    assert pool.guard(opt) is second  # and idempotent again while it is registered
    assert list(opt._optimizer_step_pre_hooks) == [second.id]
    before = state(model)
    pool.save(0)
    opt.step()
    assert not torch.equal(model.weight, before["weight"])  # the step happened...
    assert_bitwise(pool.view(0), before)  # ...after the snapshot was taken
    assert pool.slots == [0] and pool.stats()["pending_copies"] == 0
    second.remove()
    assert len(opt._optimizer_step_pre_hooks) == 0


def test_restore_returns_after_its_copy_has_finished(state, assert_bitwise):
    model = _model()
    pool = SnapshotPool(model, _copy_delay_s=DELAY_S)
    expected = state(model)
    pool.save(0)
    pool.synchronize()
    with torch.no_grad():
        model.weight.zero_()
    t0 = time.perf_counter()
    pool.restore(0)
    assert time.perf_counter() - t0 >= DELAY_S
    assert_bitwise(state(model), expected)


def test_view_waits_for_the_slots_pending_save(state, assert_bitwise):
    model = _model()
    pool = SnapshotPool(model, _copy_delay_s=DELAY_S)
    expected = state(model)
    pool.save(0)
    assert_bitwise(pool.view(0), expected)


def test_restore_waits_for_pending_saves_that_read_the_live_tensors(state, assert_bitwise, perturb):
    model = _model()
    pool = SnapshotPool(model, _copy_delay_s=DELAY_S)
    old = state(model)
    pool.save(1)
    pool.synchronize()
    perturb(model)
    new = state(model)
    pool.save(0)  # still pending when restore(1) starts overwriting the live tensors
    pool.restore(1)
    assert_bitwise(state(model), old)
    assert_bitwise(pool.view(0), new)


def test_overwrite_while_the_previous_save_is_pending_keeps_the_latest(state, assert_bitwise, perturb):
    model = _model()
    pool = SnapshotPool(model, _copy_delay_s=DELAY_S)
    pool.save(0)
    pool.fence()
    perturb(model)
    latest = state(model)
    pool.save(0)
    pool.save(0)
    assert_bitwise(pool.view(0), latest)
    assert pool.stats()["arena_allocs"] == 1


def test_clear_during_a_save_then_a_new_slot_reuses_the_arena_safely(state, assert_bitwise, perturb):
    model = _model()
    pool = SnapshotPool(model, _copy_delay_s=DELAY_S)
    pool.save(0)
    pool.clear(0)  # its arena returns to the free list while the copy into it is still pending
    pool.fence()
    perturb(model)
    expected = state(model)
    pool.save(1)
    assert_bitwise(pool.view(1), expected)
    assert pool.stats()["arena_allocs"] == 1


def _pending_in_every_kind_of_storage(pool: SnapshotPool) -> dict[str, torch.Tensor]:
    """Leaves copies pending into a slot, a copied-on-write slot and a free-listed arena; returns views that
    hold a retired arena."""
    pool.save(2)
    pool.synchronize()
    views = pool.view(2)
    pool.save(2)  # copy on write: the old arena is retired (the views hold it), the new one is being written
    pool.save(0)
    pool.save(1)
    pool.clear(1)  # its arena goes to the free list while the copy into it is still pending
    return views


def test_synchronize_and_pool_destruction_wait_for_copies_into_every_kind_of_storage(state, assert_bitwise):
    model = _model()
    expected = state(model)
    pool = SnapshotPool(model, _copy_delay_s=DELAY_S)
    views = _pending_in_every_kind_of_storage(pool)
    t0 = time.perf_counter()
    pool.synchronize()
    assert time.perf_counter() - t0 >= DELAY_S / 2
    stats = pool.stats()
    assert (stats["pending_copies"], stats["free_arenas"], stats["retired_storages"], stats["slots"]) == (0, 1, 1, 2)
    assert_bitwise(pool.view(0), expected)
    assert_bitwise(pool.view(2), expected)

    pool = SnapshotPool(model, _copy_delay_s=DELAY_S)
    views = _pending_in_every_kind_of_storage(pool)
    t0 = time.perf_counter()
    del pool  # frees arenas that copies are still writing: it must wait for them first
    assert time.perf_counter() - t0 >= DELAY_S / 2
    assert_bitwise(views, expected)  # the retired arena outlives the pool


def test_copies_release_the_gil():
    model = _model()
    pool = SnapshotPool(model, _copy_delay_s=DELAY_S)
    pool.save(0)
    pool.synchronize()
    ticks = 0
    stop = threading.Event()

    def spin() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        time.sleep(0.02)
        start_ticks = ticks
        pool.restore(0)  # blocks about DELAY_S in C++
        assert ticks - start_ticks > 1000
    finally:
        stop.set()
        thread.join()
