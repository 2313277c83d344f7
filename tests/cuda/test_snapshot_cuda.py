"""The CUDA engine: stream ordering, pinned arenas, restores seen by later kernels, overlap of a save with
compute, swapped(), the device tier, checksums. Skipped without a GPU (tests/conftest.py)."""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch

from dppo import _C
from dppo.snapshot import LayoutMismatchError, SnapshotError, SnapshotPool

pytestmark = pytest.mark.cuda

MiB = 1 << 20


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    dense = torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)
    return dense.reshape(-1).view(torch.uint8)


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a.cpu()), _bits(b.cpu()))


def _params(n: int, numel: int, seed: int = 0, dtype=torch.float32) -> dict[str, torch.nn.Parameter]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return {
        f"p{i}": torch.nn.Parameter(torch.randn(numel, device="cuda", generator=gen, dtype=dtype)) for i in range(n)
    }


def test_the_build_compiled_cuda():
    assert _C.cuda_compiled()


def test_save_is_ordered_after_work_already_queued_on_the_current_stream(spin):
    params = _params(4, 16 * MiB // 4)
    pool = SnapshotPool(params)
    new = {k: torch.randn_like(p) for k, p in params.items()}
    torch.cuda.synchronize()
    with torch.no_grad():
        spin(50)  # a long kernel, then the writes the save must see
        for k, p in params.items():
            p.copy_(new[k])
    pool.save(0)  # no host sync in between
    pool.synchronize()
    for k, v in pool.view(0).items():
        assert _equal(v, new[k]), k


def test_save_does_not_block_the_host(spin):
    params = _params(2, 64 * MiB // 4)
    pool = SnapshotPool(params)
    pool.save(0)
    pool.synchronize()  # arena allocated and pinned: the next save is the steady state
    torch.cuda.synchronize()
    spin(200)
    t0 = time.perf_counter()
    pool.save(0)  # waits behind the 200 ms kernel on the GPU, not on the host
    pool.fence()  # so does the fence: the current stream waits, the host does not
    assert time.perf_counter() - t0 < 0.1
    pool.synchronize()
    assert time.perf_counter() - t0 >= 0.15


def test_restore_is_seen_by_kernels_queued_right_after_it():
    params = _params(3, 64 * MiB // 4, seed=1)
    expected = {k: p.detach().clone() for k, p in params.items()}
    pool = SnapshotPool(params)
    pool.save(0)
    pool.fence()
    with torch.no_grad():
        for p in params.values():
            p.zero_()
    pool.restore(0)
    sums = [p.detach().double().sum() for p in params.values()]  # queued at once, no host sync
    clones = [p.detach().clone() for p in params.values()]
    torch.cuda.synchronize()
    for (k, e), s, c in zip(expected.items(), sums, clones):
        assert s.item() == e.double().sum().item()
        assert _equal(c, e), k


def test_restore_waits_for_a_pending_save_of_the_live_weights():
    params = _params(2, 64 * MiB // 4, seed=2)
    pool = SnapshotPool(params)
    old = {k: p.detach().clone() for k, p in params.items()}
    pool.save(1)
    pool.fence()
    with torch.no_grad():
        for p in params.values():
            p.add_(1.0)
    new = {k: p.detach().clone() for k, p in params.items()}
    pool.save(0)  # pending: reads the live weights that restore(1) overwrites
    pool.restore(1)
    torch.cuda.synchronize()
    for k in params:
        assert _equal(params[k], old[k]) and _equal(pool.view(0)[k], new[k])


def test_a_pool_follows_the_callers_current_stream_not_the_default_one(spin):
    params = _params(2, 16 * MiB // 4, seed=10)
    pool = SnapshotPool(params)
    new = {k: torch.randn_like(p) for k, p in params.items()}
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side), torch.no_grad():
        spin(50)  # on the side stream: the default stream stays idle
        for k, p in params.items():
            p.copy_(new[k])
        pool.save(0)  # ordered after the side stream's writes
        pool.fence()  # the side stream waits for the save before the writes below
        for p in params.values():
            p.zero_()
        pool.restore(0)
        seen = {k: p.clone() for k, p in params.items()}  # the side stream sees the restore
    torch.cuda.synchronize()
    for k in params:
        assert _equal(seen[k], new[k]) and _equal(pool.view(0)[k], new[k]), k


def test_host_arenas_are_pinned_and_exact():
    params = _params(3, MiB + 3)
    pool = SnapshotPool(params)
    pool.save(0)
    assert pool.tier(0) == "host"
    views = pool.view(0)
    assert all(v.device.type == "cpu" and v.is_pinned() for v in views.values())
    assert pool.host_bytes < pool.nbytes * 1.01 + MiB
    assert pool.stats()["arena_allocs"] == 1


def test_round_trip_of_dtypes_strided_and_many_small_tensors():
    gen = torch.Generator(device="cuda").manual_seed(3)
    tensors = {f"small{i}": torch.randn(i + 1, device="cuda", generator=gen) for i in range(300)}  # batched copies
    tensors["bf16"] = torch.randn(1000, 17, device="cuda", generator=gen).to(torch.bfloat16)
    tensors["i64"] = torch.randint(-5, 5, (999,), device="cuda", generator=gen)
    tensors["bool"] = torch.rand(333, device="cuda", generator=gen) > 0.5
    tensors["t"] = torch.randn(300, 200, device="cuda", generator=gen).t()
    tensors["cl"] = torch.randn(2, 8, 5, 5, device="cuda", generator=gen).to(memory_format=torch.channels_last)
    expected = {k: t.clone() for k, t in tensors.items()}
    pool = SnapshotPool(tensors)
    pool.save(0)
    pool.fence()
    for t in tensors.values():
        t.copy_(~t if t.dtype == torch.bool else t + 1)
    pool.restore(0)
    torch.cuda.synchronize()
    for k in tensors:
        assert _equal(tensors[k], expected[k]), k
        assert _equal(pool.view(0)[k], expected[k]), k


def test_arenas_pinned_in_many_chunks_round_trip_with_strided_tensors_across_chunks():
    chunk = 16 * os.sysconf("SC_PAGE_SIZE")  # 64 KiB with 4 KiB pages: the slot spans about 60 registrations
    gen = torch.Generator(device="cuda").manual_seed(11)
    tensors = {
        "w": torch.randn(3 * MiB // 4 + 5, device="cuda", generator=gen),
        "t": torch.randn(300, 200, device="cuda", generator=gen).t(),  # strided, 240 KB: crosses chunks
        "cl": torch.randn(4, 32, 17, 17, device="cuda", generator=gen).to(memory_format=torch.channels_last),
        "b": torch.randn(257, device="cuda", generator=gen),
    }
    pool = SnapshotPool(tensors, _pin_chunk_bytes=chunk, _swap_chunk_bytes=chunk)
    saved = {k: t.clone() for k, t in tensors.items()}
    pool.save(0)
    pool.fence()
    for t in tensors.values():
        t.mul_(-2.0).add_(1.0)
    live = {k: t.clone() for k, t in tensors.items()}
    views = pool.view(0)
    assert all(v.is_pinned() for v in views.values())  # interior pointers of every chunk are pinned
    with pool.swapped(0):
        inside = {k: t.clone() for k, t in tensors.items()}
    after = {k: t.clone() for k, t in tensors.items()}
    streamed = {}
    with pool.streamer(0, [["w"], ["t", "cl"], ["b"]]) as st:
        assert st.mode == "staged"
        for i in range(st.steps):
            streamed |= {k: v.clone() for k, v in st.acquire(i).items()}
            st.release(i)
    pool.restore(0)
    torch.cuda.synchronize()
    for k in tensors:
        assert _equal(views[k], saved[k]) and _equal(inside[k], saved[k]) and _equal(streamed[k], saved[k]), k
        assert _equal(after[k], live[k]) and _equal(tensors[k], saved[k]), k
    pool.release()  # unregisters and frees the swap scratch, chunk by chunk
    assert pool.host_bytes < pool.nbytes * 1.01 + MiB


def test_copies_never_span_two_device_allocations():
    torch.cuda.empty_cache()  # fresh cudaMallocs below: consecutive ones are often adjacent in address space
    gen = torch.Generator(device="cuda").manual_seed(12)
    numel = 16 * MiB // 4  # >= 10 MiB: torch's allocator gives each its own segment unless one is cached
    tensors = {f"w{i}": torch.empty(numel, device="cuda").normal_(generator=gen) for i in range(6)}
    base = torch.randn(2 * numel, device="cuda", generator=gen)
    tensors |= {"lo": base[:numel], "hi": base[numel:]}  # one allocation: one copy
    segments = [(s["address"], s["address"] + s["total_size"]) for s in torch.cuda.memory_snapshot()]

    def segment(ptr: int) -> int:
        return next(i for i, (lo, hi) in enumerate(segments) if lo <= ptr < hi)

    spans = sorted((t.data_ptr(), t.data_ptr() + numel * 4) for t in tensors.values())
    joined = sum(
        1 for (_, end), (start, _) in zip(spans, spans[1:]) if end == start and segment(end - 1) == segment(start)
    )
    across = sum(
        1 for (_, end), (start, _) in zip(spans, spans[1:]) if end == start and segment(end - 1) != segment(start)
    )
    print(f"{across} pairs adjacent across allocations, {joined} within one")
    pool = SnapshotPool(tensors)
    assert pool._core.runs == len(tensors) - joined
    saved = {k: t.clone() for k, t in tensors.items()}
    pool.save(0)
    pool.fence()
    for t in tensors.values():
        t.zero_()
    pool.restore(0)
    torch.cuda.synchronize()
    assert all(_equal(tensors[k], saved[k]) and _equal(pool.view(0)[k], saved[k]) for k in tensors)


def test_save_overlaps_a_matmul_measured_with_cuda_events():
    params = _params(8, 64 * MiB // 4)  # 512 MiB to copy device-to-host
    pool = SnapshotPool(params)
    pool.save(0)
    pool.synchronize()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def timed(save: bool, matmuls: int) -> float:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if save:
            pool.save(0)
        for _ in range(matmuls):
            a @ a
        if save:
            pool.fence()  # the current stream waits for the save
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    reps = 5
    matmuls = 20
    save_ms = statistics.median(timed(True, 0) for _ in range(reps))
    mm_ms = statistics.median(timed(False, matmuls) for _ in range(reps))
    both_ms = statistics.median(timed(True, matmuls) for _ in range(reps))
    print(f"save {save_ms:.2f} ms, matmuls {mm_ms:.2f} ms, both {both_ms:.2f} ms")
    assert both_ms < 0.85 * (save_ms + mm_ms)  # the copy ran while the matmuls did


def test_guard_makes_an_optimizer_step_after_an_async_save_safe(spin):
    model = torch.nn.Linear(4096, 8192, device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(16, 4096, device="cuda")).square().sum().backward()
    pool = SnapshotPool(model)
    pool.guard(opt)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    torch.cuda.synchronize()
    spin(20)  # the save is queued behind this, so the step would overtake it without the fence
    pool.save(0)
    opt.step()
    pool.synchronize()
    for k, v in pool.view(0).items():
        assert _equal(v, before[k]), k
    assert not torch.equal(model.weight, before["weight"])


@pytest.mark.parametrize("chunk_mib", [1, 64])
def test_swapped_interleaves_and_restores_the_live_weights_even_on_error(chunk_mib):
    gen = torch.Generator(device="cuda").manual_seed(4)
    tensors = {f"w{i}": torch.randn(3 * MiB // 4 + i, device="cuda", generator=gen) for i in range(6)}
    tensors["t"] = torch.randn(100, 300, device="cuda", generator=gen).t()
    pool = SnapshotPool(tensors, _swap_chunk_bytes=chunk_mib * MiB)
    old = {k: t.clone() for k, t in tensors.items()}
    pool.save(0)
    pool.fence()
    for t in tensors.values():
        t.mul_(-3.0)
    live = {k: t.clone() for k, t in tensors.items()}
    with pytest.raises(RuntimeError, match="boom"):
        with pool.swapped(0):
            seen = {k: t.clone() for k, t in tensors.items()}  # kernels queued inside see slot 0
            raise RuntimeError("boom")
    after = {k: t.clone() for k, t in tensors.items()}  # queued right after exit: must see the live weights
    torch.cuda.synchronize()
    for k in tensors:
        assert _equal(seen[k], old[k]) and _equal(after[k], live[k]) and _equal(tensors[k], live[k]), k
    assert pool.stats()["swap"]["count"] == 2


def test_device_tier_holds_slots_within_the_budget_and_hosts_the_rest():
    params = _params(2, 8 * MiB // 4, seed=5)
    probe = SnapshotPool(params)
    budget = probe._core.storage_bytes + 1024  # room for one slot on the device
    pool = SnapshotPool(params, device_budget_bytes=budget)
    saved = {k: p.detach().clone() for k, p in params.items()}
    pool.save(0)
    pool.save(1)
    assert pool.tier(0) == "device" and pool.tier(1) == "host"
    assert pool.device_bytes >= pool.nbytes and pool.host_bytes < 2 * pool.nbytes
    views = pool.view(0)
    assert all(v.is_cuda for v in views.values())
    pool.fence()
    with torch.no_grad():
        for p in params.values():
            p.zero_()
    pool.restore(0)
    torch.cuda.synchronize()
    assert all(_equal(params[k], saved[k]) for k in params)
    with torch.no_grad():
        for p in params.values():
            p.zero_()
    with pool.swapped(0):
        inside = {k: p.detach().clone() for k, p in params.items()}
    torch.cuda.synchronize()
    assert all(_equal(inside[k], saved[k]) for k in params)
    assert all(torch.count_nonzero(p) == 0 for p in params.values())
    del views  # a view keeps its slot's buffer (and its budget) alive
    pool.clear(0)
    pool.save(2)  # the freed budget is used again
    assert pool.tier(2) == "device"


def test_view_of_a_device_slot_is_ordered_after_its_pending_save(spin):
    params = _params(2, 16 * MiB // 4, seed=8)
    pool = SnapshotPool(params, device_budget_bytes=64 * MiB)
    pool.save(0)
    pool.synchronize()  # slot 0 holds the old weights
    new = {k: torch.randn_like(p) for k, p in params.items()}
    torch.cuda.synchronize()
    with torch.no_grad():
        spin(50)
        for k, p in params.items():
            p.copy_(new[k])
    pool.save(0)  # in place, device to device, behind the 50 ms kernel; not waited for
    assert pool.tier(0) == "device"
    seen = {k: v.clone() for k, v in pool.view(0).items()}  # queued at once on the current stream
    torch.cuda.synchronize()
    for k in params:
        assert _equal(seen[k], new[k]), k


def test_a_completed_device_save_is_checksummed_without_waiting_for_the_current_stream(spin):
    params = _params(2, MiB, seed=9)  # 8 MiB a slot
    pool = SnapshotPool(params, checksum=True, device_budget_bytes=64 * MiB)
    pool.save(0)
    pool.save(1)
    torch.cuda.synchronize()  # both saves are done; their checksums are taken by the next pool call
    spin(300)
    t0 = time.perf_counter()
    pool.save(1)  # settles both checksums (and overwrites slot 1 in place, after the kernel, on the GPU)
    assert time.perf_counter() - t0 < 0.1
    assert pool.tier(0) == "device" and pool.tier(1) == "device"
    live = {k: p.detach().clone() for k, p in params.items()}
    pool.restore(0)  # verifies slot 0 against the checksum taken above
    torch.cuda.synchronize()
    assert all(_equal(params[k], live[k]) for k in params)


def test_checksum_catches_corruption_on_both_tiers():
    params = _params(2, MiB, seed=6)  # 8 MiB a slot
    pool = SnapshotPool(params, checksum=True, device_budget_bytes=12 * MiB)
    pool.save(0)
    pool.save(1)
    assert pool.tier(0) == "device" and pool.tier(1) == "host"
    live = {k: p.detach().clone() for k, p in params.items()}
    for k in (0, 1):
        pool.view(k)["p1"][7] += 1.0
        with pytest.raises(SnapshotError, match=f"slot {k} fails its checksum"):
            pool.restore(k)
    torch.cuda.synchronize()
    assert all(_equal(params[k], live[k]) for k in params)


def test_tensors_on_two_devices_are_rejected_naming_both():
    with pytest.raises(LayoutMismatchError, match=r"'a' is on cuda:0 but 'b' is on cpu"):
        SnapshotPool({"a": torch.zeros(3, device="cuda"), "b": torch.zeros(3)})


def test_pool_destruction_waits_for_pending_copies(spin):
    """Dropping a pool whose save is still queued behind a 200 ms kernel returns only once the copy into its host
    arenas has run (arenas are unpinned and freed only after it): by then the kernel the copy was ordered after has
    finished too, no copy faulted on freed memory, and the tensors the copies read are untouched."""
    params = _params(2, 64 * MiB // 4, seed=7)
    before = {k: p.detach().clone() for k, p in params.items()}
    stream = torch.cuda.current_stream()
    for _ in range(3):
        pool = SnapshotPool(params)
        pool.save(0)
        pool.synchronize()  # arenas allocated and pinned: the next save is only queued (as in the test above)
        torch.cuda.synchronize()
        spin(200)
        t0 = time.perf_counter()
        pool.save(0)
        assert not stream.query(), "the kernel was done before the save was queued: no copy was pending at del"
        del pool
        waited_s = time.perf_counter() - t0
        assert stream.query(), "del returned while the kernel the save's copy waits for was still running"
        assert waited_s >= 0.15, f"del returned after {waited_s:.3f} s, before the 200 ms kernel and the copy behind it"
    torch.cuda.synchronize()  # a copy into unpinned, unmapped memory would surface here as a CUDA error
    assert all(_equal(params[k], before[k]) for k in params)


def test_inference_tensors_restore_and_swap_bitwise_including_strided_ones_across_chunks():
    with torch.inference_mode():
        gen = torch.Generator(device="cuda").manual_seed(0)
        tensors = {
            "w": torch.randn(MiB, device="cuda", generator=gen),
            "t": torch.randn(1024, 1024, device="cuda", generator=gen).t(),
        }  # 4 MiB, strided
    pool = SnapshotPool(tensors, _pin_chunk_bytes=MiB)  # "t" crosses pinning chunks: the temporary path
    saved = {k: t.clone() for k, t in tensors.items()}
    pool.save(0)
    pool.fence()
    with torch.inference_mode():
        for t in tensors.values():
            t.mul_(-3.0)
    live = {k: t.clone() for k, t in tensors.items()}
    with pool.swapped(0):
        assert all(_equal(tensors[k], saved[k]) for k in tensors)
    assert all(_equal(tensors[k], live[k]) for k in tensors)
    pool.restore(0)
    assert all(_equal(tensors[k], saved[k]) for k in tensors)


def test_reserve_makes_free_arenas_so_the_first_swapped_block_allocates_nothing():
    params = _params(2, MiB)
    pool = SnapshotPool(params)
    pool.save(0)
    pool.reserve(1)
    allocs = pool.stats()["arena_allocs"]
    with pool.swapped(0):
        pass
    assert pool.stats()["arena_allocs"] == allocs == 2
