"""Helpers for the CUDA tests (fixtures: test files cannot import each other)."""

from __future__ import annotations

import functools

import pytest
import torch


@functools.cache
def _cycles_per_ms() -> float:
    """GPU clock cycles per millisecond of torch.cuda._sleep, measured once with CUDA events.

    _sleep counts SM clock cycles, and an idle GPU runs a fraction of its boost clock (an H200 idles near
    345 MHz and boosts to about 1980 MHz). A rate measured while the clock ramps up would make later
    sleeps several times shorter than asked, so the GPU is kept busy first and the fastest of a few
    measurements is kept: spin(ms) then lasts at least `ms` at any clock up to the one measured.
    """
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # 0.1 s at boost clock, longer while the clock ramps up
    rates = []
    for _ in range(3):
        cycles = 20_000_000
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        rates.append(cycles / max(start.elapsed_time(end), 1e-3))
    return max(rates)


@pytest.fixture
def spin():
    """spin(ms): queue a kernel on the current stream that keeps the GPU busy for at least about `ms` ms."""

    rate = _cycles_per_ms()  # calibrated now, not in the middle of the first test that spins

    def queue(ms: float) -> None:
        torch.cuda._sleep(int(ms * rate))

    return queue
