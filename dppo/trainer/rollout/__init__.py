"""Where the trainer's groups come from: Ray rollout workers (sources.RayRollout), local worker processes
(local.LocalRollout) or a generator in the trainer's own process (sources.InProcessRollout)."""
