"""Typed configuration of `dppo train`: the schema (schema.py), the rules across sections (rules.py), the names
each key accepts and the decisions made from them (choices.py), loading, overrides and --help (load.py), and
the shipped defaults (train.yaml)."""

from dppo.config.checks import ConfigError, machine_cpus
from dppo.config.load import DEFAULTS_YAML, describe, list_keys, load_config, to_dict, to_yaml
from dppo.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    CustomRewardFunctionConfig,
    DataConfig,
    DppoConfig,
    ModelConfig,
    RayConfig,
    ReplayConfig,
    RolloutConfig,
    RolloutCorrectionSection,
    SnapshotConfig,
    TaskConfig,
    TrainerConfig,
)

__all__ = [
    "DEFAULTS_YAML",
    "ActorConfig",
    "AlgorithmConfig",
    "ConfigError",
    "CustomRewardFunctionConfig",
    "DataConfig",
    "DppoConfig",
    "ModelConfig",
    "RayConfig",
    "ReplayConfig",
    "RolloutConfig",
    "RolloutCorrectionSection",
    "SnapshotConfig",
    "TaskConfig",
    "TrainerConfig",
    "describe",
    "list_keys",
    "load_config",
    "machine_cpus",
    "to_dict",
    "to_yaml",
]
