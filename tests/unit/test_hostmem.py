"""dppo.hostmem: freed host memory stays in the process instead of going back to the kernel."""

import os
import platform
import subprocess
import sys

import pytest

from dppo.hostmem import keep_freed_host_memory

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt tuning applies to glibc only")

# Mallocs and frees a 100 MB block through libc and asks glibc (mallinfo2) whether the block was mmap'ed
# on its own, and whether its pages were kept in the heap after free().
_PROBE = """
import ctypes
from dppo.hostmem import keep_freed_host_memory
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
applied = keep_freed_host_memory()
size = 100 << 20
block = libc.malloc(size)
ctypes.memset(block, 1, size)
mmapped = libc.mallinfo2().hblkhd >= size
libc.free(block)
kept = libc.mallinfo2().fordblks >= size
print(applied is not None, mmapped, kept)
"""


def _probe(tuning: str) -> list[bool]:
    env = {**os.environ, "DPPO_MALLOC_TUNING": tuning}
    env.pop("LD_PRELOAD", None)
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    return [word == "True" for word in out.stdout.split()]


@glibc_only
def test_large_blocks_come_from_the_heap_and_stay_there():
    # glibc's defaults: a 100 MB block gets its own mmap and goes back to the kernel on free(), so the
    # next allocation page-faults it in again
    assert _probe("0") == [False, True, False]
    # tuned: the block comes from the heap and its pages stay mapped after free() for the next one
    assert _probe("1") == [True, False, True]


@pytest.mark.parametrize("bad", [0, -1, 2**31, 1.5, True, "1"])
def test_bad_thresholds_are_rejected_naming_the_value(bad):
    with pytest.raises(ValueError, match="mmap_threshold_bytes") as err:
        keep_freed_host_memory(mmap_threshold_bytes=bad)
    assert repr(bad) in str(err.value)
    with pytest.raises(ValueError, match="trim_threshold_bytes"):
        keep_freed_host_memory(trim_threshold_bytes=bad)


_BOUNDED_PROBE = _PROBE.replace(
    "applied = keep_freed_host_memory()",
    "keep_freed_host_memory(); from dppo.hostmem import bound_retention; applied = bound_retention(10 << 20)",
)


@glibc_only
def test_a_bounded_process_hands_back_blocks_larger_than_its_step():
    # a step that frees 10 MB: the bound is MIN_RETENTION_BYTES (64 MB), so a 100 MB block is mmap'ed on its own
    # and goes back to the kernel on free(), as with glibc's defaults
    env = {**os.environ, "DPPO_MALLOC_TUNING": "1"}
    env.pop("LD_PRELOAD", None)
    out = subprocess.run([sys.executable, "-c", _BOUNDED_PROBE], env=env, capture_output=True, text=True, check=True)
    assert [word == "True" for word in out.stdout.split()] == [True, True, False]


def test_bound_retention_leaves_an_untuned_process_alone_and_rejects_bad_bytes(monkeypatch):
    import dppo.hostmem as hostmem

    monkeypatch.setattr(hostmem, "_applied", None)
    assert hostmem.bound_retention(1 << 30) is None
    with pytest.raises(ValueError, match="step_bytes"):
        hostmem.bound_retention(-1)


@glibc_only
def test_a_step_above_the_untuned_size_gets_glibcs_thresholds_back():
    code = (
        "from dppo.hostmem import keep_freed_host_memory, bound_retention, UNTUNED_ABOVE_BYTES; "
        "keep_freed_host_memory(); print(bound_retention(UNTUNED_ABOVE_BYTES + 1))"
    )
    env = {**os.environ, "DPPO_MALLOC_TUNING": "1"}
    env.pop("LD_PRELOAD", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str({"mmap_threshold_bytes": 128 << 10, "trim_threshold_bytes": 128 << 10})
