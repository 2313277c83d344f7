"""Keep freed host memory in the process instead of handing it back to the kernel after every step.

torch's CPU allocator takes every tensor from malloc. With glibc's defaults, large blocks are mmap'ed
and munmap'ed one by one and the top of the heap is trimmed as soon as it is free, so a training step
on the CPU that frees and re-allocates its gradients and activations page-faults all of them in again:
on the 42M-parameter model of benchmarks/cycle_bench.py about 150,000-300,000 minor faults per sync
cycle, a tenth of the cycle's time and most of its cycle-to-cycle noise. Raising glibc's mmap and trim
thresholds makes malloc reuse those pages (0-1,000 faults per cycle in the same measurement), as a
caching allocator would. The cost is that the process keeps up to `trim_threshold_bytes` of freed
memory mapped.

`dppo train` and the benchmarks call keep_freed_host_memory() at start; set DPPO_MALLOC_TUNING=0 to
leave malloc alone. Once a process knows what its own step frees and allocates again (an actor rank: its
gradients and activations; a rollout worker: its KV cache and logits), bound_retention(step_bytes) lowers both
thresholds to that and hands back what it kept beyond: one-off frees (a model converted to another dtype, weights
loaded once) then go back to the kernel instead of staying mapped beside the next process's peak. Other allocators (jemalloc, tcmalloc via LD_PRELOAD) and non-glibc systems are
left as they are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

# glibc's mallopt parameter numbers (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

DEFAULT_MMAP_THRESHOLD_BYTES = 1 << 30
DEFAULT_TRIM_THRESHOLD_BYTES = 2**31 - 1  # the largest value mallopt takes (an int)

_applied: dict[str, int] | None = None


def keep_freed_host_memory(
    mmap_threshold_bytes: int = DEFAULT_MMAP_THRESHOLD_BYTES,
    trim_threshold_bytes: int = DEFAULT_TRIM_THRESHOLD_BYTES,
) -> dict[str, int] | None:
    """Raise glibc's mmap and trim thresholds for this process; returns what was set, or None if nothing was.

    Nothing is set where the C library is not glibc, where malloc is not glibc's (LD_PRELOAD), or where
    DPPO_MALLOC_TUNING=0. Idempotent: a second call returns the first call's settings.
    """
    global _applied
    for name, value in (("mmap_threshold_bytes", mmap_threshold_bytes), ("trim_threshold_bytes", trim_threshold_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 2**31:
            raise ValueError(f"{name} must be an int in [1, 2**31 - 1] (mallopt takes an int), got {value!r}")
    if _applied is not None:
        return _applied
    if os.environ.get("DPPO_MALLOC_TUNING", "1") == "0" or os.environ.get("LD_PRELOAD"):
        return None
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = {"mmap_threshold_bytes": mmap_threshold_bytes, "trim_threshold_bytes": trim_threshold_bytes}
    if not mallopt(_M_MMAP_THRESHOLD, settings["mmap_threshold_bytes"]):
        return None  # glibc refused the value: leave the trim threshold alone too
    mallopt(_M_TRIM_THRESHOLD, settings["trim_threshold_bytes"])
    _applied = settings
    return settings


MIN_RETENTION_BYTES = 64 << 20  # below this, bounding saves little and costs page faults on every step
# A step that frees more than this leaves malloc as glibc has it: on a 0.5B model the tuning kept 0.2-0.45 GiB more
# in each rank (benchmarks/memory_bench.py, issue 23) for no measurable gain in step time, which page faults
# weigh little in at that size (they matter on small models' short steps, where the tuning stays on).
UNTUNED_ABOVE_BYTES = 512 << 20
_GLIBC_DEFAULT_THRESHOLD_BYTES = 128 << 10  # glibc's initial mmap and trim thresholds


def bound_retention(step_bytes: int) -> dict[str, int] | None:
    """Where keep_freed_host_memory applied its settings: lower both thresholds to step_bytes (at least
    MIN_RETENTION_BYTES, at most what is set), the bytes this process's own step frees and allocates again, and
    give back what it keeps beyond (malloc_trim); above UNTUNED_ABOVE_BYTES, glibc's defaults again. Returns the
    settings now in force, or None where malloc is left alone."""
    global _applied
    if not isinstance(step_bytes, int) or isinstance(step_bytes, bool) or step_bytes < 0:
        raise ValueError(f"step_bytes must be a non-negative int, got {step_bytes!r}")
    if _applied is None:
        return None
    bound = max(MIN_RETENTION_BYTES, step_bytes)
    settings = {name: min(value, bound) for name, value in _applied.items()}
    if step_bytes > UNTUNED_ABOVE_BYTES:  # glibc's own thresholds again
        settings = dict.fromkeys(_applied, _GLIBC_DEFAULT_THRESHOLD_BYTES)
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    libc.mallopt(_M_MMAP_THRESHOLD, settings["mmap_threshold_bytes"])
    libc.mallopt(_M_TRIM_THRESHOLD, settings["trim_threshold_bytes"])
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    libc.malloc_trim(0)
    _applied = settings
    return settings
