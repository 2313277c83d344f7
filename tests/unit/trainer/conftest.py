"""Small, fast trainer configs for the unit tests (in-process rollout, no Ray)."""

import pytest

from dppo.trainer.config import load_config


def small_overrides(tmp_path, **extra) -> list[str]:
    values = {
        "trainer.total_steps": 2,
        "trainer.parameter_sync_step": 2,
        "trainer.train_batch_size": 4,
        "trainer.output_dir": str(tmp_path / "run"),
        "trainer.eval_prompts": 8,
        "trainer.progress_bar": False,
        "trainer.mode": "sync",
        "trainer.checkpoint_every": 0,
        "ray.enabled": False,
        "rollout.n": 4,
        "rollout.groups_per_batch": 2,
        "task.length": 3,
        "model.hidden_size": 32,
        "model.num_hidden_layers": 1,
        "model.num_attention_heads": 2,
        "model.intermediate_size": 64,
        "actor.micro_batch_size": 5,  # not a divisor of the batch: exercises uneven micro-batches
    }
    values.update(extra)
    return [f"{k}={'null' if v is None else v}" for k, v in values.items()]


@pytest.fixture
def small_cfg(tmp_path):
    """small_cfg(**{"dotted.key": value}) -> a validated DppoConfig for a tiny in-process run."""

    def make(**extra):
        return load_config(small_overrides(tmp_path, **extra))

    return make


@pytest.fixture
def small_args(tmp_path):
    """small_args(**{"dotted.key": value}) -> small_cfg's settings as `dppo train` key=value arguments."""
    return lambda **extra: small_overrides(tmp_path, **extra)
