"""A new local cluster gets the workers' environment from the driver's, not as a job runtime_env: the workers Ray
prestarts when the cluster starts know no job's runtime_env, and only without one can they serve the run's actors."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray

from dppo.launch.ray_cluster import init_ray, shutdown_ray

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


KEYS = ("PYTHONPATH", "HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM", "OMP_NUM_THREADS")


@ray.remote(num_cpus=0)
def _worker_view() -> tuple[dict, str]:
    import dppo

    return {k: os.environ.get(k) for k in KEYS}, dppo.__file__


def test_a_new_local_cluster_inherits_the_workers_environment(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # the driver's own value: the workers get rollout.num_threads
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    cfg = SimpleNamespace(ray=SimpleNamespace(address=None, num_cpus=2), rollout=SimpleNamespace(num_threads=1))
    before = {k: os.environ.get(k) for k in KEYS}
    assert init_ray(cfg.ray, cfg.rollout.num_threads)
    try:
        assert {k: os.environ.get(k) for k in KEYS} == before  # the driver's environment is put back
        assert not ray.get_runtime_context().runtime_env  # no job runtime_env: prestarted workers fit the actors
        env, package = ray.get(_worker_view.remote(), timeout=120)
        assert env["OMP_NUM_THREADS"] == "1" and env["TOKENIZERS_PARALLELISM"] == "false"
        assert env["HF_HUB_OFFLINE"] == "1" and env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)
        assert Path(package) == REPO / "dppo" / "__init__.py"
    finally:
        shutdown_ray()  # Ray, and the watchdog init_ray started
