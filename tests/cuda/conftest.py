"""Helpers for the CUDA tests (fixtures: test files cannot import each other)."""

from __future__ import annotations

import functools

import pytest
import torch


@functools.cache
def _cycles_per_ms() -> float:
    """GPU clock cycles per millisecond of torch.cuda._sleep, measured once with CUDA events."""
    cycles = 10_000_000
    torch.cuda._sleep(cycles)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / max(start.elapsed_time(end), 1e-3)


@pytest.fixture
def spin():
    """spin(ms): queue a kernel on the current stream that keeps the GPU busy for about `ms` milliseconds."""

    def queue(ms: float) -> None:
        torch.cuda._sleep(int(ms * _cycles_per_ms()))

    return queue
