"""make_engine: the engine rollout.name names, built from its EngineSettings (a rollout worker's, the trainer's
evaluation engine, `dppo eval`'s); and whether the trainer publishes deltas for it. The settings are read from a
run's config once, on the driver's side (dppo.trainer.rollout.settings.engine_settings): neither the engines
(dppo.workers.rollout.engines) nor the workers ever see the config."""

from __future__ import annotations

import torch

from dppo.workers.rollout.engines import EngineSettings, RolloutEngine, engine_spec


def make_engine(name: str, settings: EngineSettings, model_config, device: str | torch.device = "cpu") -> RolloutEngine:
    """The engine name (rollout.name) names, built from settings, with model_config's model (the trainer model's
    transformers config; the weights arrive with load_weights), on device (the worker's)."""
    return engine_spec(name).build(settings, model_config, torch.device(device))


def publishes_deltas(rollout) -> bool:
    """Whether the trainer publishes what changed next to the full weights (rollout: the config's rollout section):
    rollout.weight_sync=delta with an engine whose spec accepts deltas (any other loads the full weights)."""
    return rollout.weight_sync == "delta" and engine_spec(rollout.name).accepts_delta
