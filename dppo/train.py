"""The main job: build the trainer from a config, train, and report where the outputs are.

`python -m dppo.train [key=value ...]` is the same as `dppo train [key=value ...]`.
"""

from __future__ import annotations

import sys
from typing import TextIO

from dppo.trainer.base import RunResult
from dppo.trainer.config import DppoConfig, to_yaml


def run(cfg: DppoConfig, out: TextIO | None = None) -> RunResult:
    """Train with cfg, print the summary and the output paths to out (default: the current sys.stdout), and
    shut down a Ray cluster we started (one the caller had connected to stays up)."""
    from dppo.trainer.ppo import PPOTrainer
    from dppo.trainer.rollout_source import init_ray

    from dppo.hostmem import keep_freed_host_memory

    out = sys.stdout if out is None else out
    keep_freed_host_memory()  # CPU steps reuse their freed gradients' pages instead of faulting them in again
    started_ray = cfg.ray.enabled and init_ray(cfg)
    try:
        trainer = PPOTrainer(cfg)
        (trainer.output_dir / "config.yaml").write_text(to_yaml(cfg))
        if trainer.resumed_from is not None:
            print(f"resumed from {trainer.resumed_from} (global step {trainer.global_step})", file=out)
        result = trainer.fit()
    finally:
        if started_ray:
            import ray

            ray.shutdown()
    print("\nsummary:", file=out)
    print(result.summary_table(), file=out)
    print(f"\nmetrics: {result.metrics_path}", file=out)
    if result.plot_path is not None:
        print(f"plot:    {result.plot_path}", file=out)
    print(f"summary: {result.summary_path}", file=out)
    return result


def main(argv: list[str] | None = None) -> int:
    from dppo.cli import main as cli_main

    return cli_main(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
