"""benchmarks/memory_bench.py's pure parts: a process's role from its proc title, the sampler's peaks over a real
process tree, and the principled figure of issue 23."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from bench_scripts import load_bench  # tests/bench_scripts.py (tests/conftest.py puts tests/ on sys.path)


@pytest.fixture(scope="module")
def bench():
    yield from load_bench("memory_bench")


def test_roles_come_from_ray_proc_titles(bench):
    assert bench.role_of("python -m dppo train x=1", is_root=True) == "driver"
    assert bench.role_of("ray::ActorRank.update_actor", is_root=False) == "actor_rank"
    assert bench.role_of("ray::RolloutWorkerActor.step", is_root=False) == "rollout_worker"
    assert bench.role_of("ray::ReplayBufferActor", is_root=False) == "replay_buffer"
    assert bench.role_of("/x/raylet --store_socket_name=...", is_root=False) == "ray_runtime"
    # a local rollout worker of a run without Ray: the driver's command line, its own name
    assert bench.role_of("python -m dppo train x=1", is_root=False, comm="dppo-rollout-0") == "rollout_worker"


def test_the_principled_figure_is_24_bytes_a_parameter_in_fp32_and_12_in_bf16(bench):
    assert bench.principled_bytes(1000, 4) == 24_000
    assert bench.principled_bytes(1000, 2) == 12_000


def test_the_sampler_sees_a_child_that_holds_memory(bench):
    # a child that touches 200 MB, says so and waits: the tree's summed PSS holds it, under no actor's role
    code = "b = bytearray(200 << 20); print('ready', flush=True); import sys; sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"ready"
        sampler = bench.Sampler(os.getpid())
        sampler.sample()
        assert sampler.peaks[child.pid].rss_bytes > 200 << 20
        assert sampler.peaks[child.pid].role == "ray_runtime"  # neither the root nor a Ray actor
        assert sampler.peak_total_pss_bytes >= sampler.peaks[child.pid].pss_bytes
    finally:
        child.communicate(b"", timeout=30)
