"""The driver: the step loop (base.py, ppo.py), score-ahead (score_ahead.py), the actor's worker group
(worker_group.py), rollout sources (rollout_source.py), checkpoints and resume (checkpoint.py, resume.py),
pre-flight checks (preflight.py), the Ray connection (ray_cluster.py) and reports (report.py). It orchestrates
and does no math: that runs on the workers (dppo.workers) and lives in dppo.algo."""

from dppo.trainer.base import BaseTrainer, RunResult
from dppo.trainer.ppo import PPOTrainer

__all__ = ["BaseTrainer", "PPOTrainer", "RunResult"]
