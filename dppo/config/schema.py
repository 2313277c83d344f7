"""The config schema of `dppo train`: DppoConfig, the whole config, assembled from its sections (dppo.config.sections:
one dataclass per section, a docstring per field, each section's own rules in its __post_init__). Key names follow
verl where verl has one (trainer.parameter_sync_step, algorithm.rollout_correction.bypass_mode, ...). Rules across
sections are in dppo.config.rules; loading and --help in dppo.config.load."""

from __future__ import annotations

from dataclasses import dataclass, field

from dppo.config.rules import validate_combinations
from dppo.config.sections.actor import ActorCheckpointSection, ActorConfig, ActorOptimSection, PolicyLossSection
from dppo.config.sections.algorithm import (
    AlgorithmConfig,
    FilterGroupsSection,
    KLControlSection,
    RolloutCorrectionSection,
)
from dppo.config.sections.data import (
    CustomRewardFunctionConfig,
    DataConfig,
    ModelConfig,
    ReasoningGymSection,
    TaskConfig,
)
from dppo.config.sections.rollout import ReplayConfig, RolloutConfig
from dppo.config.sections.run import RayConfig, SnapshotConfig, TrainerConfig

__all__ = [
    "ActorCheckpointSection",
    "ActorConfig",
    "ActorOptimSection",
    "AlgorithmConfig",
    "CustomRewardFunctionConfig",
    "DataConfig",
    "DppoConfig",
    "FilterGroupsSection",
    "KLControlSection",
    "ModelConfig",
    "PolicyLossSection",
    "RayConfig",
    "ReasoningGymSection",
    "ReplayConfig",
    "RolloutConfig",
    "RolloutCorrectionSection",
    "SnapshotConfig",
    "TaskConfig",
    "TrainerConfig",
]


@dataclass
class DppoConfig:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self) -> None:
        validate_combinations(self)

    @property
    def use_ray(self) -> bool:
        """Whether the run's roles are Ray actors: ray.enabled, or where it is null (auto), whether its keys need Ray
        (see RayConfig.enabled; what the machine adds to the rule, RAY_ADDRESS and a GPU under trainer.device=auto,
        dppo.launch.machine.resolve_ray decides before the run starts)."""
        if self.ray.enabled is not None:
            return self.ray.enabled
        t, r = self.trainer, self.rollout
        return bool(self.ray.address or t.nnodes * t.n_gpus_per_node > 1 or r.n_gpus_per_node or t.device == "cuda")

    @property
    def groups_per_trigger(self) -> int:
        """Prompt groups each optimizer step consumes."""
        return self.trainer.train_batch_size // self.trainer.parameter_sync_step
