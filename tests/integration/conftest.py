"""A local Ray cluster shared by a module's in-process runs."""

import os

import pytest


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster, started as a user's own script would (plain ray.init), for the runs of one module that
    drive dppo.launch.run in this process: run() uses a cluster its caller started and leaves it up. Module-scoped:
    starting a cluster costs more than most of the runs it serves."""
    import ray

    saved = os.environ.pop("RAY_ADDRESS", None)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        yield
    finally:
        ray.shutdown()
        if saved is not None:
            os.environ["RAY_ADDRESS"] = saved
