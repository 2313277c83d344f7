"""The config's sections, one module per group of them (run, actor, algorithm, rollout, data)."""
