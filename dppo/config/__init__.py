"""Typed configuration of `dppo train`: the schema (schema.py), the rules across sections (rules.py), the names
each key accepts and the decisions made from them (choices.py, pi_old.py), loading, overrides and --help (load.py),
and the shipped defaults (train.yaml).

The config is plain data: importing it loads no torch, transformers or reasoning-gym, and building one reads nothing
but its values (tests/unit/config/test_config_imports.py). The checks of a run, by kind, and where each lives:

    one key's value          its section's __post_init__ (sections/), with the helpers of checks.py
    keys of several sections rules.py, run by DppoConfig.__post_init__ once every section has passed its own
    names a key accepts      choices.py; dppo.algo's in dppo.algo_names, pi_old's in dppo.pi_old_names (torch-free)
    the machine              dppo.launch.machine: the GPU trainer.device names, the CPUs the threads need, the model
                             directory and the data and reward files, RAY_ADDRESS
    what must be built       dppo.launch.preflight: a task's factory imported and its held-out prompts drawn, a
                             reasoning-gym dataset built, the engine imported, the model's positions and the memory
                             (from the run's plan), the output directory, the cluster once joined

All of them run before anything starts, each a one-line ConfigError (exit code 2) naming the key and the value (a
missing data file: DataFileError, 6; an output directory that cannot be written: OutputDirError, 3)."""

from dppo.config.checks import ConfigError
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
    "to_dict",
    "to_yaml",
]
