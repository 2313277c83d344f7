"""Rollout engines, chosen by rollout.name: hf (dppo's sampler, the default), vllm (vllm.LLM in the worker), or a
RolloutEngine subclass of the user's own by class path (package.module:Class). Each engine module declares its
EngineSpec (spec.py); registry.engine_spec resolves rollout.name to it, importing the engine's module only then."""

from __future__ import annotations

from dppo.workers.rollout.engines.base import Refresh, RolloutEngine, Samples, WeightSync
from dppo.workers.rollout.engines.registry import (
    EngineImportError,
    NotAnEngineError,
    UnknownEngineError,
    builtin_engine_names,
    engine_spec,
)
from dppo.workers.rollout.engines.spec import EngineSettings, EngineSpec, WorkerLoad, batch_rows

__all__ = [
    "EngineImportError",
    "EngineSettings",
    "EngineSpec",
    "NotAnEngineError",
    "Refresh",
    "RolloutEngine",
    "Samples",
    "UnknownEngineError",
    "WeightSync",
    "WorkerLoad",
    "batch_rows",
    "builtin_engine_names",
    "engine_spec",
]
