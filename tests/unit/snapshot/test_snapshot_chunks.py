"""Copies that respect the pinning chunks of host arenas (CUDA arenas are registered chunk by chunk and no
copy may span two registrations). CPU pools run the same splitting paths when given a chunk size, so these
tests hold them to bitwise round trips here; tests/cuda repeats them on pinned memory."""

from __future__ import annotations

import os

import pytest
import torch

from dppo.snapshot import SnapshotPool

PAGE = os.sysconf("SC_PAGE_SIZE")


def _tensors() -> dict[str, torch.Tensor]:
    """Contiguous and strided tensors, most larger than one page, so that every kind crosses a chunk."""
    gen = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(10_000, generator=gen),  # 10 chunks
        "t": torch.randn(64, 48, generator=gen).t(),  # strided, 3 chunks
        "bf16_t": torch.randn(100, 70, generator=gen).to(torch.bfloat16).t(),  # strided, odd size
        "cl": torch.randn(2, 16, 9, 9, generator=gen).contiguous(memory_format=torch.channels_last),
        "mask_t": (torch.randn(90, 91, generator=gen) > 0).t(),  # strided bool
        "tiny_t": torch.randn(3, 5, generator=gen).t(),  # strided, inside a chunk
        "scalar": torch.tensor(2.5),
    }


def _scramble(tensors) -> None:
    with torch.no_grad():
        for t in tensors.values():
            t.copy_(~t if t.dtype == torch.bool else t * -3 + 1)


@pytest.mark.parametrize("chunk_pages", [1, 3])
def test_round_trips_are_bitwise_when_copies_split_at_chunk_boundaries(chunk_pages, state, assert_bitwise):
    tensors = _tensors()
    saved = state(tensors)
    pool = SnapshotPool(tensors, _pin_chunk_bytes=chunk_pages * PAGE, _swap_chunk_bytes=PAGE)
    assert pool._core.storage_bytes > 4 * chunk_pages * PAGE  # the slot spans several chunks
    pool.save(0)
    pool.fence()
    _scramble(tensors)
    live = state(tensors)
    assert_bitwise(pool.view(0), saved)
    with pool.swapped(0):
        assert_bitwise(tensors, saved)
    assert_bitwise(tensors, live)
    pool.restore(0)
    assert_bitwise(tensors, saved)
    with pool.streamer(0, [["w", "t"], ["bf16_t", "cl", "mask_t"], ["tiny_t", "scalar"]]) as st:
        for i in range(st.steps):
            got = st.acquire(i)
            assert_bitwise(got, {k: saved[k] for k in got})
            st.release(i)
    pool.synchronize()
    stats = pool.stats()
    assert stats["save"]["bytes"] == pool.nbytes and stats["restore"]["bytes"] == pool.nbytes


@pytest.mark.parametrize("bad", [-PAGE, 1000, PAGE + 1])
def test_a_pinning_chunk_that_is_not_a_page_multiple_is_rejected(bad):
    with pytest.raises(
        ValueError,
        match=rf"pin_chunk_bytes must be 0 or a positive multiple of the page size "
        rf"\({PAGE}\), got {bad}",
    ):
        SnapshotPool({"w": torch.zeros(4)}, _pin_chunk_bytes=bad)


def test_tensors_adjacent_in_host_memory_share_one_copy_range(state, assert_bitwise):
    base = torch.randn(3000)
    tensors = {"a": base[:1000], "b": base[1000:2500], "c": base[2500:], "apart": torch.randn(77)}
    saved = state(tensors)
    pool = SnapshotPool(tensors)
    assert pool._core.runs == 2  # a, b, c in one range; the separate allocation in another
    pool.save(0)
    pool.fence()
    _scramble(tensors)
    pool.restore(0)
    assert_bitwise(tensors, saved)
