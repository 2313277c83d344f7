"""The key=value overrides of a tiny run that the integration tests start as a user would: a one-layer model on a
three-digit task, two triggers per cycle of 4 groups of 4, staleness limit THRESHOLD. A test adds or replaces keys
after these (the last value of a key wins)."""

from __future__ import annotations

from pathlib import Path

THRESHOLD = 1  # replay.max_off_policy_threshold of a tiny run


def tiny_run(output_dir: Path, total_steps: int, *extra: str) -> list[str]:
    return [
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
