"""Host memory: exact-size arenas, reuse through the free list, reserve/release, copy on write for views."""

from __future__ import annotations

import mmap

import torch

from dppo.snapshot import SnapshotPool

PAGE = mmap.PAGESIZE


def _arena_bytes(pool: SnapshotPool) -> int:
    return pool.stats()["arena_alloc_bytes"] // max(pool.stats()["arena_allocs"], 1)


def test_host_bytes_is_exact_and_within_one_percent_plus_one_mib_of_the_bytes_held(tiny_lm):
    model = tiny_lm(dim=64, layers=4)
    pool = SnapshotPool(model)
    assert pool.host_bytes == 0
    for k in range(3):
        pool.save(k)
    arena = _arena_bytes(pool)
    assert arena % PAGE == 0
    assert pool.host_bytes == 3 * arena
    held = 3 * pool.nbytes
    assert held <= pool.host_bytes <= held * 1.01 + (1 << 20)


def test_no_power_of_two_rounding():
    pool = SnapshotPool({"x": torch.zeros(5 * (1 << 20) // 4 + 1)})  # 5 MiB + 4 bytes
    pool.save(0)
    assert pool.host_bytes == -(-(pool.nbytes) // PAGE) * PAGE < 8 << 20


def test_host_bytes_stays_constant_over_500_save_clear_cycles(tiny_lm):
    model = tiny_lm()
    pool = SnapshotPool(model)
    pool.save(0)
    held = pool.host_bytes
    for i in range(500):
        pool.save(1 + i % 3)
        pool.clear(1 + i % 3)
        assert pool.host_bytes == 2 * held or pool.host_bytes == held
    pool.synchronize()
    stats = pool.stats()
    assert stats["arena_allocs"] == 2  # slot 0's arena and one arena cycling through the free list
    assert pool.host_bytes == 2 * held
    assert stats["save"]["count"] == 501


def test_save_into_an_existing_slot_allocates_nothing(tiny_lm, perturb, state, assert_bitwise):
    model = tiny_lm()
    pool = SnapshotPool(model)
    pool.save(0)
    for _ in range(20):
        pool.fence()
        perturb(model)
        pool.save(0)
    assert_bitwise(pool.view(0), state(model))
    assert pool.stats()["arena_allocs"] == 1


def test_reserve_preallocates_so_that_n_new_slots_allocate_nothing(tiny_lm):
    model = tiny_lm()
    pool = SnapshotPool(model)
    pool.reserve(4)
    allocs = pool.stats()["arena_allocs"]
    assert allocs == 4 and pool.stats()["free_arenas"] == 4
    held = pool.host_bytes
    for k in (7, 3, 11, 0):
        pool.save(k)
    assert pool.stats()["arena_allocs"] == allocs and pool.host_bytes == held
    pool.reserve(2)  # n free arenas: filled slots do not count
    assert pool.stats()["arena_allocs"] == allocs + 2 and pool.stats()["free_arenas"] == 2
    pool.reserve(1)  # already satisfied
    assert pool.stats()["arena_allocs"] == allocs + 2


def test_reserve_covers_the_swap_scratch_so_the_first_swapped_block_allocates_nothing(tiny_lm):
    model = tiny_lm()
    pool = SnapshotPool(model)
    pool.save(0)
    pool.reserve(1)
    stats = pool.stats()
    assert stats["arena_allocs"] == 2 and stats["free_arenas"] == 1
    held = pool.host_bytes
    with pool.swapped(0):
        pass
    assert pool.stats()["arena_allocs"] == 2 and pool.host_bytes == held


def test_release_frees_idle_arenas_only(tiny_lm):
    model = tiny_lm()
    pool = SnapshotPool(model)
    pool.reserve(3)
    pool.save(0)
    one = pool.host_bytes // 3
    with pool.swapped(0):
        pass  # creates the swap scratch (from the free list)
    assert pool.host_bytes == 3 * one
    pool.release()
    assert pool.host_bytes == one and pool.slots == [0]
    assert pool.stats()["arena_frees"] == 2
    pool.restore(0)


def test_views_keep_their_snapshot_when_the_slot_is_overwritten_or_cleared(tiny_lm, perturb, state, assert_bitwise):
    model = tiny_lm()
    pool = SnapshotPool(model)
    first = state(model)
    pool.save(0)
    views = pool.view(0)
    pool.fence()
    perturb(model)
    second = state(model)
    pool.save(0)  # copy on write: the views still read the first snapshot
    assert pool.stats()["arena_allocs"] == 2
    assert_bitwise(views, first)
    assert_bitwise(pool.view(0), second)
    pool.clear(0)
    assert_bitwise(views, first)  # cleared, but the arena stays until the views die
    assert pool.host_bytes == 2 * _arena_bytes(pool)
    del views
    pool.save(5)  # the arena held by the views came back to the free list: no allocation
    assert pool.stats()["arena_allocs"] == 2
    assert pool.host_bytes == 2 * _arena_bytes(pool)


def test_stats_count_bytes_and_throughput(tiny_lm):
    model = tiny_lm()
    pool = SnapshotPool(model)
    pool.save(0)
    pool.restore(0)
    pool.view(0)
    with pool.swapped(0):
        pass
    pool.synchronize()
    stats = pool.stats()
    assert stats["save"]["count"] == 1 and stats["save"]["bytes"] == pool.nbytes
    assert stats["restore"]["count"] == 1 and stats["restore"]["bytes"] == pool.nbytes
    assert stats["view"]["count"] == 1 and stats["view"]["bytes"] == 0  # a view copies nothing
    assert stats["swap"]["count"] == 2 and stats["swap"]["bytes"] == 3 * pool.nbytes
    for op in ("save", "restore", "swap"):
        assert stats[op]["seconds"] > 0 and stats[op]["gbps"] > 0
    assert stats["host_bytes"] == pool.host_bytes and stats["slots"] == 1


def test_stats_bytes_are_the_bytes_each_op_copied():
    torch.manual_seed(0)
    w = torch.randn(64, 48)
    tensors = {"w": w, "w_tied": w, "t": torch.randn(48, 40).t(), "b": torch.randn(40)}  # tied, strided
    pool = SnapshotPool(tensors)
    n = pool.nbytes
    assert n == (64 * 48 + 48 * 40 + 40) * 4  # tied tensors once
    pool.save(0)
    pool.restore(0)
    pool.view(0)
    for _ in range(2):
        with pool.swapped(0):  # live -> scratch, slot -> live; scratch -> live
            pass
    with pool.streamer(0, [["w"], ["t", "b"]]) as st:  # CPU: the slot is read in place
        for i in range(st.steps):
            st.acquire(i)
            st.release(i)
    pool.synchronize()
    stats = pool.stats()
    got = {op: (stats[op]["count"], stats[op]["bytes"]) for op in ("save", "restore", "swap", "view", "stream")}
    assert got == {"save": (1, n), "restore": (1, n), "swap": (4, 2 * 3 * n), "view": (1, 0), "stream": (1, 0)}
    assert stats["view"]["gbps"] == stats["stream"]["gbps"] == stats["stream"]["seconds"] == 0
    assert stats["pending_copies"] == 0 and stats["slots"] == 1


def test_cpu_pools_never_initialize_cuda(tiny_lm):
    model = tiny_lm()
    pool = SnapshotPool(model, checksum=True)
    pool.save(0)
    pool.restore(0)
    with pool.swapped(0):
        pass
    with pool.streamer(0, [["embed.weight"]]) as st:
        st.acquire(0)
        st.release(0)
    assert not torch.cuda.is_initialized()
    assert pool.device_bytes == 0 and pool.tier(0) == "host"
