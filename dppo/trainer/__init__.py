"""The Decoupled PPO trainer: config, the step loop, old-log-prob strategies, rollout sources."""

from dppo.trainer.base import BaseTrainer, RunResult
from dppo.trainer.config import ConfigError, DppoConfig, load_config
from dppo.trainer.ppo import PPOTrainer

__all__ = ["BaseTrainer", "ConfigError", "DppoConfig", "PPOTrainer", "RunResult", "load_config"]
