"""Everything before a run's first step: the run's entry (run.py), the pre-flight checks (preflight.py), the memory
estimate (memory_estimate.py) and the Ray connection (ray_cluster.py)."""
