"""Text-data configs for tiny in-process runs on the example's model and data."""

import pytest

from dppo.trainer.config import load_config


def text_overrides(tmp_path, example, **extra) -> list[str]:
    values = {
        "model.path": example["model"],
        "data.train_files": example["train"],
        "data.val_files": example["val"],
        "data.max_prompt_length": 32,
        "data.max_response_length": 6,
        "custom_reward_function.path": example["reward"],
        "trainer.total_steps": 2,
        "trainer.parameter_sync_step": 2,
        "trainer.train_batch_size": 4,
        "trainer.output_dir": tmp_path / "run",
        "trainer.progress_bar": False,
        "trainer.mode": "sync",
        "trainer.checkpoint_every": 0,
        "ray.enabled": False,
        "rollout.n": 4,
        "rollout.groups_per_batch": 2,
        "actor.micro_batch_size": 5,  # not a divisor of the batch: exercises uneven micro-batches
    }
    values.update(extra)
    return [f"{k}={'null' if v is None else v}" for k, v in values.items()]


@pytest.fixture
def text_args(tmp_path, text_example):
    """text_args(**{"dotted.key": value}) -> the key=value overrides of a tiny in-process text run."""

    def make(**extra):
        return text_overrides(tmp_path, text_example, **extra)

    return make


@pytest.fixture
def text_cfg(text_args):
    """text_cfg(**{"dotted.key": value}) -> a validated DppoConfig of a tiny in-process text run."""

    def make(**extra):
        return load_config(text_args(**extra))

    return make
