"""A copy that fails is reported once, by the first pool call that observes it, and the pool keeps working: a failed
save's slot is dropped (its bytes are partial) and its arena goes back to the free list."""

from __future__ import annotations

import time

import pytest
import torch

from dppo.snapshot import EmptySlotError, SnapshotError, SnapshotPool

# CPU copy tasks of the pools below, numbered in issue order: "w" is one task, the strided "t" another, so every
# save, restore or swapped() copy is two tasks.
TASKS_PER_COPY = 2


def _tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"w": torch.randn(4096), "t": torch.randn(64, 32).t()}


def _negate(tensors: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for t in tensors.values():
            t.mul_(-1.0)


# Calls that report a failed save at once: they wait for the slot's save, or for every pending save.
WAITING = {
    "synchronize": lambda pool: pool.synchronize(),
    "fence": lambda pool: pool.fence(),
    "view": lambda pool: pool.view(0),
    "restore": lambda pool: pool.restore(0),
    "swapped": lambda pool: pool.swapped(0).__enter__(),
}
# Calls that report it once it has completed, without waiting for it.
NOT_WAITING = {
    "stats": lambda pool: pool.stats(),
    "reserve": lambda pool: pool.reserve(0),
    "release": lambda pool: pool.release(),
}


def _observe(observer: str, pool: SnapshotPool) -> SnapshotError:
    """The error of the first call of `observer` that reports the failed save."""
    if observer in WAITING:
        with pytest.raises(SnapshotError) as raised:
            WAITING[observer](pool)
        return raised.value
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the injected failure completes at once, but on a worker thread
        try:
            NOT_WAITING[observer](pool)
        except SnapshotError as err:
            return err
        time.sleep(0.01)
    pytest.fail("the failed save was never reported")


@pytest.mark.parametrize("observer", [*WAITING, *NOT_WAITING])
def test_a_failed_save_is_raised_once_drops_its_slot_and_the_pool_keeps_working(observer, state, assert_bitwise):
    tensors = _tensors()
    pool = SnapshotPool(tensors, _fail_copy_task=TASKS_PER_COPY)  # slot 1's save is fine, slot 0's fails
    one = state(tensors)
    pool.save(1)
    pool.synchronize()
    _negate(tensors)
    live = state(tensors)
    pool.save(0)
    err = _observe(observer, pool)
    assert f"save(0) failed: injected failure of CPU copy task {TASKS_PER_COPY} " in str(err)
    assert "slot 0 is empty now" in str(err)
    assert_bitwise(state(tensors), live)  # the call that reported it changed nothing

    # Reported once: every call works from here on, and the failed slot is empty.
    pool.synchronize()
    stats = pool.stats()
    assert 0 not in pool and 1 in pool
    assert stats["failed_copies"] == 1 and stats["pending_copies"] == 0
    assert stats["free_arenas"] == 1  # slot 0's arena went back
    assert stats["arena_allocs"] == 2
    for op in (pool.restore, pool.view, pool.clear):
        with pytest.raises(EmptySlotError, match=r"slot 0 is empty \(filled slots: \[1\]\)"):
            op(0)
    with pytest.raises(EmptySlotError):
        pool.swapped(0).__enter__()
    assert_bitwise(state(tensors), live)
    assert_bitwise(pool.view(1), one)
    pool.restore(1)
    assert_bitwise(state(tensors), one)
    pool.save(0)  # a new save into the slot works, in the free-listed arena
    pool.clear(1)
    pool.save(1)
    pool.synchronize()
    assert pool.slots == [0, 1] and pool.stats()["arena_allocs"] == 2
    assert_bitwise(pool.view(0), one)
    _negate(tensors)
    with pool.swapped(0):
        assert_bitwise(state(tensors), one)
    assert_bitwise(state(tensors), live)
    pool.restore(1)
    assert_bitwise(state(tensors), one)
    assert pool.stats()["failed_copies"] == 1


def test_a_failed_save_of_a_slot_cleared_meanwhile_is_raised_once_and_its_arena_serves_again(state, assert_bitwise):
    tensors = _tensors()
    pool = SnapshotPool(tensors, _fail_copy_task=0, _copy_delay_s=0.2)
    pool.save(0)
    pool.clear(0)  # before the copy has failed
    pool.save(2)  # takes the arena that the failing save still writes; waits for it, then saves
    with pytest.raises(
        SnapshotError, match=r"save\(0\) failed: injected failure .*slot 0 had been cleared or saved again"
    ):
        pool.synchronize()
    pool.synchronize()
    stats = pool.stats()
    assert pool.slots == [2] and stats["failed_copies"] == 1 and stats["arena_allocs"] == 1
    assert_bitwise(pool.view(2), state(tensors))


def test_a_save_over_a_failing_save_keeps_the_later_save_and_reports_the_failure_once(state, assert_bitwise):
    tensors = _tensors()
    pool = SnapshotPool(tensors, _fail_copy_task=0, _copy_delay_s=0.2)
    pool.save(0)
    pool.save(0)  # overwrites in place while the first save is pending: it waits for it, then copies everything
    with pytest.raises(
        SnapshotError, match=r"save\(0\) failed: injected failure .*slot 0 had been cleared or saved again"
    ):
        pool.synchronize()
    pool.synchronize()
    stats = pool.stats()
    assert pool.slots == [0] and stats["failed_copies"] == 1 and stats["save"]["count"] == 1
    assert_bitwise(pool.view(0), state(tensors))


def test_a_failed_restore_is_raised_by_restore_only(state, assert_bitwise):
    tensors = _tensors()
    pool = SnapshotPool(tensors, _fail_copy_task=TASKS_PER_COPY)  # the restore's first task
    saved = state(tensors)
    pool.save(0)
    pool.synchronize()
    _negate(tensors)
    with pytest.raises(SnapshotError, match=f"injected failure of CPU copy task {TASKS_PER_COPY} "):
        pool.restore(0)
    pool.synchronize()  # not raised a second time
    stats = pool.stats()
    assert stats["failed_copies"] == 1 and stats["restore"]["count"] == 0 and pool.slots == [0]
    pool.restore(0)
    assert_bitwise(state(tensors), saved)
    assert pool.stats()["restore"]["count"] == 1
