"""Streaming a host slot to the device step by step (issue 5): values bitwise equal to the slot, at most
two steps resident, kernels after acquire see the step even when its copy is slow, staging reused."""

from __future__ import annotations

import pytest
import torch

from dppo.snapshot import SnapshotError, SnapshotPool

pytestmark = pytest.mark.cuda

MiB = 1 << 20


def _layered(layers: int, numel: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tensors = {"embed": torch.randn(numel, device="cuda", generator=gen)}
    schedule = [["embed"]]
    for i in range(layers):
        tensors[f"l{i}.w"] = torch.randn(numel, device="cuda", generator=gen)
        tensors[f"l{i}.b"] = torch.randn(257, device="cuda", generator=gen)
        schedule.append([f"l{i}.w", f"l{i}.b"])
    schedule.append(["embed"])  # a tied tensor used first and last
    return tensors, schedule


def test_streamed_values_equal_the_slot_bitwise_and_live_weights_stay():
    tensors, schedule = _layered(6, 4 * MiB // 4)
    pool = SnapshotPool(tensors)
    saved = {k: t.clone() for k, t in tensors.items()}
    pool.save(0)
    pool.fence()
    for t in tensors.values():
        t.add_(1.0)
    live = {k: t.clone() for k, t in tensors.items()}
    seen = []
    with pool.streamer(0, schedule) as st:
        assert st.mode == "staged"
        for i in range(st.steps):
            params = st.acquire(i)
            assert all(p.is_cuda for p in params.values())
            seen.append({k: p.clone() for k, p in params.items()})
            st.release(i)
    torch.cuda.synchronize()
    for names, got in zip(schedule, seen):
        assert list(got) == names
        for k in names:
            assert torch.equal(got[k], saved[k]), k
    assert all(torch.equal(tensors[k], live[k]) for k in tensors)


def test_staging_holds_at_most_two_steps_and_is_reused():
    tensors, schedule = _layered(5, 8 * MiB // 4, seed=1)
    pool = SnapshotPool(tensors)
    pool.save(0)
    pool.synchronize()
    largest = max(sum(tensors[n].numel() * 4 for n in step) for step in schedule)
    st = pool.streamer(0, schedule)
    assert 2 * largest <= st.staging_bytes <= 2 * (largest + 4096 + 256)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    peak_extra = 0
    with st:
        for i in range(st.steps):
            st.acquire(i)
            peak_extra = max(peak_extra, torch.cuda.memory_allocated() - base)
            st.release(i)
    assert peak_extra <= st.staging_bytes + 4096
    allocs = pool.stats()["staging_allocs"]
    assert allocs == 2
    with pool.streamer(0, schedule) as again:  # same schedule: nothing new allocated
        for i in range(again.steps):
            again.acquire(i)
            again.release(i)
    assert pool.stats()["staging_allocs"] == allocs
    pool.synchronize()
    stream = pool.stats()["stream"]
    pass_bytes = sum(tensors[n].nbytes for step in schedule for n in step)
    assert stream["count"] == 2  # one per pass
    assert 2 * pass_bytes <= stream["bytes"] <= 2 * (pass_bytes + len(schedule) * 4096)  # + gaps copied with a step


def test_kernels_after_acquire_see_the_step_even_when_copies_and_kernels_are_slow(spin):
    tensors, schedule = _layered(4, 64 * MiB // 4, seed=2)  # 64 MiB steps: each copy takes a while
    pool = SnapshotPool(tensors)
    saved = {k: t.clone() for k, t in tensors.items()}
    pool.save(0)
    pool.synchronize()
    for t in tensors.values():
        t.zero_()
    sums, clones = [], []
    with pool.streamer(0, schedule) as st:
        for i in range(st.steps):
            params = st.acquire(i)
            spin(5)  # a slow consumer: step i+2 must not overwrite this buffer before the reads below
            sums.append({k: p.double().sum() for k, p in params.items()})
            clones.append({k: p.clone() for k, p in params.items()})
            st.release(i)
    torch.cuda.synchronize()
    for step_sums, step_clones in zip(sums, clones):
        for k in step_sums:
            assert step_sums[k].item() == saved[k].double().sum().item(), k
            assert torch.equal(step_clones[k], saved[k]), k


def test_a_streamer_begun_right_after_a_save_streams_what_the_save_wrote(spin):
    tensors, schedule = _layered(4, 16 * MiB // 4, seed=5)
    pool = SnapshotPool(tensors)
    pool.save(0)
    pool.synchronize()  # slot 0 holds the old values
    new = {k: torch.randn_like(t) for k, t in tensors.items()}
    torch.cuda.synchronize()
    spin(50)
    for k, t in tensors.items():
        t.copy_(new[k])
    pool.save(0)  # in place, behind the 50 ms kernel; not waited for
    seen = {}
    with pool.streamer(0, schedule) as st:  # each load must wait for the save, not only for the kernel
        for i in range(st.steps):
            seen |= {k: p.clone() for k, p in st.acquire(i).items()}
            st.release(i)
    torch.cuda.synchronize()
    for k in tensors:
        assert torch.equal(seen[k], new[k]), k


def test_device_tier_slot_is_streamed_in_place():
    tensors, schedule = _layered(3, MiB // 4, seed=3)
    pool = SnapshotPool(tensors, device_budget_bytes=64 * MiB)
    pool.save(0)
    assert pool.tier(0) == "device"
    slot = pool.view(0)
    with pool.streamer(0, schedule) as st:
        assert st.mode == "device" and st.staging_bytes == 0
        for i in range(st.steps):
            params = st.acquire(i)
            assert all(p.data_ptr() == slot[k].data_ptr() for k, p in params.items())  # zero copies
            st.release(i)
    stats = pool.stats()
    assert stats["staging_allocs"] == 0
    assert (stats["stream"]["count"], stats["stream"]["bytes"]) == (1, 0)  # the pass is counted, nothing copied


def test_streamed_forward_matches_functional_call_over_the_slot():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(6)]).cuda()
    pool = SnapshotPool(model)
    pool.save(0)
    pool.fence()
    x = torch.randn(32, 512, device="cuda")
    with torch.no_grad():
        slot = {k: v.cuda() for k, v in pool.view(0).items()}  # a host slot: its views are CPU tensors
        want = torch.func.functional_call(model, slot, (x,))
        for p in model.parameters():
            p.add_(1.0)  # the live weights moved on; the pass must not use them
        schedule = [[f"{i}.weight", f"{i}.bias"] for i in range(6)]
        h = x
        with pool.streamer(0, schedule) as st:
            for i, layer in enumerate(model):
                params = {k.split(".", 1)[1]: v for k, v in st.acquire(i).items()}
                h = torch.func.functional_call(layer, params, (h,))
                st.release(i)
    assert torch.allclose(h, want, rtol=0, atol=1e-6)


def test_one_active_streamer_per_pool_and_ordering_errors():
    tensors, schedule = _layered(3, MiB // 4, seed=4)
    pool = SnapshotPool(tensors)
    pool.save(0)
    a, b = pool.streamer(0, schedule), pool.streamer(0, schedule)
    with a:
        with pytest.raises(SnapshotError, match="another streamer of this pool is active"):
            b.begin()
        a.acquire(0)
        a.acquire(1)
        with pytest.raises(SnapshotError, match=r"acquire\(2\) before release\(0\)"):
            a.acquire(2)
    with b:  # a ended: b may stream now
        b.acquire(0)
