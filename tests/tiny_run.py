"""The key=value overrides of the tests' tiny runs, in one place.

tiny_run: the run the integration tests start as a user would, on Ray (a one-layer model on a three-digit task, two
triggers per cycle of 4 groups of 4, staleness limit THRESHOLD; a test adds or replaces keys after these, the last
value of a key wins). small_overrides, text_overrides and reasoning_gym_overrides: the in-process runs of the unit tests
(sync mode, no Ray), on the integer task, on text data and on reasoning-gym problems."""

from __future__ import annotations

from pathlib import Path

THRESHOLD = 1  # replay.max_off_policy_threshold of a tiny run


def tiny_run(output_dir: Path, total_steps: int, *extra: str) -> list[str]:
    """On Ray (the integration tests of Ray's roles); a test passes ray.enabled=null or false after it for the local
    processes that a one-machine CPU run gets by default."""
    return [
        "ray.enabled=true",
        f"trainer.output_dir={output_dir}",
        f"trainer.total_steps={total_steps}",
        "trainer.parameter_sync_step=2",
        "trainer.train_batch_size=8",
        "trainer.eval_prompts=16",
        "trainer.progress_bar=false",
        "rollout.n=4",
        "rollout.groups_per_batch=4",
        f"replay.max_off_policy_threshold={THRESHOLD}",
        "task.length=3",
        "model.hidden_size=32",
        "model.num_hidden_layers=1",
        "model.num_attention_heads=2",
        "model.intermediate_size=64",
        *extra,
    ]


# The in-process runs' common settings: sync mode without Ray, two triggers of 2 groups of 4, no checkpoints.
_IN_PROCESS = {
    "trainer.total_steps": 2,
    "trainer.parameter_sync_step": 2,
    "trainer.train_batch_size": 4,
    "trainer.progress_bar": False,
    "trainer.mode": "sync",
    "trainer.checkpoint_every": 0,
    "ray.enabled": False,
    "rollout.n": 4,
    "rollout.groups_per_batch": 2,
    "actor.micro_batch_size": 5,  # not a divisor of the batch: exercises uneven micro-batches
}


def _as_overrides(values: dict, extra: dict) -> list[str]:
    values = {**values, **extra}
    return [f"{k}={'null' if v is None else v}" for k, v in values.items()]


def small_overrides(tmp_path, **extra) -> list[str]:
    """A tiny in-process run (sync mode, no Ray, one-layer model, three-digit task) under tmp_path/run, with the
    {"dotted.key": value} of extra added or replaced."""
    return _as_overrides(
        {
            **_IN_PROCESS,
            "trainer.output_dir": tmp_path / "run",
            "trainer.eval_prompts": 8,
            "task.length": 3,
            "model.hidden_size": 32,
            "model.num_hidden_layers": 1,
            "model.num_attention_heads": 2,
            "model.intermediate_size": 64,
        },
        extra,
    )


def text_overrides(tmp_path, example, **extra) -> list[str]:
    """A tiny in-process run on text data: the example's model, parquet files and reward function (the
    text_example fixture), with the {"dotted.key": value} of extra added or replaced."""
    return _as_overrides(
        {
            **_IN_PROCESS,
            "trainer.output_dir": tmp_path / "run",
            "model.path": example["model"],
            "data.train_files": example["train"],
            "data.val_files": example["val"],
            "data.max_prompt_length": 32,
            "data.max_response_length": 6,
            "custom_reward_function.path": example["reward"],
        },
        extra,
    )


# basic_arithmetic with two terms of 1 or 2 digits, + and -: the reasoning-gym problems of the tiny runs
BASIC_ARITHMETIC = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": "[+,-]"}


def reasoning_gym_overrides(tmp_path, model_dir, **extra) -> list[str]:
    """A tiny in-process run on reasoning-gym's basic_arithmetic (64 training problems, 8 held out) with the model of
    model_dir (the tiny_smollm fixture's), with the {"dotted.key": value} of extra added or replaced."""
    return _as_overrides(
        {
            **_IN_PROCESS,
            "trainer.output_dir": tmp_path / "run",
            "model.path": model_dir,
            "data.source": "reasoning_gym",
            "data.reasoning_gym.dataset": "basic_arithmetic",
            **{f"data.reasoning_gym.config.{key}": value for key, value in BASIC_ARITHMETIC.items()},
            "data.reasoning_gym.size": 64,
            "data.reasoning_gym.val_size": 8,
            "data.max_prompt_length": 96,
            "data.max_response_length": 8,
        },
        extra,
    )
