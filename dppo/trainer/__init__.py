"""The driver: the step loop (base.py, ppo.py), score-ahead (score_ahead.py), the actor's worker group
(worker_group.py), the rollout sources (rollout/) and reports (report.py). It orchestrates and does no math: that
runs on the workers (dppo.workers) and lives in dppo.algo. What comes before the first step is dppo.launch's;
saving and resuming, dppo.checkpoint's."""

from dppo.trainer.base import BaseTrainer, RunResult
from dppo.trainer.ppo import PPOTrainer

__all__ = ["BaseTrainer", "PPOTrainer", "RunResult"]
