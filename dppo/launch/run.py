"""The main job: build the trainer from a config, train, and report where the outputs are (`dppo train`, or
`python -m dppo train`, parses the command line and calls run)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TextIO

import ray

from dppo.config import DppoConfig, to_yaml
from dppo.data import make_prompt_source
from dppo.hostmem import keep_freed_host_memory
from dppo.trainer.base import RunResult, find_resume_point
from dppo.trainer import ppo
from dppo.launch.plan import plan_run
from dppo.launch.preflight import (
    check_checkpoint_space,
    check_cluster_fits,
    check_output_dir,
    check_prompt_source,
    check_rollout_engine,
    check_sequence_length,
    check_training_memory,
)
from dppo.launch.machine import check_machine, resolve_ray
from dppo.launch.precision import resolve_precision
from dppo.launch.ray_cluster import init_ray, probe_cluster, shutdown_ray
from dppo.data.source import PromptSource
from dppo.trainer.rollout.source import RolloutSource
from dppo.trainer.trackers import check_installed

RolloutOf = Callable[[DppoConfig, PromptSource], RolloutSource]


def run(
    cfg: DppoConfig, out: TextIO | None = None, rollout_of: RolloutOf | None = None, stop_after: int | None = None
) -> RunResult:
    """Train with cfg, print the summary and the output paths to out (default: the current sys.stdout), and
    shut down a Ray cluster we started (one the caller had connected to stays up). rollout_of(cfg, source): where the
    groups come from instead of the rollout cfg asks for (`dppo replay`: a run's schedule); stop_after: end after this
    global step, checkpointed there (`dppo replay --until`; trainer.total_steps, which the lr schedule counts with, stays).

    Before any Ray process starts: the output directory is written to, the model's training memory is checked
    against what is available, and the checkpoint to resume from (trainer.resume) is chosen and its trainer
    state read. The actor's ranks (Ray actors with ray.enabled) then build the model and load their shards.
    actor.mixed_precision=auto and rollout.dtype=auto are decided first (one line printed), and the run, its plan and
    its config.yaml see the decision."""
    out = sys.stdout if out is None else out
    cfg = resolve_ray(cfg)  # ray.enabled=null decided with what only this machine knows
    check_machine(cfg)  # the GPU, the CPUs, the model directory and the data files the config names
    check_prompt_source(cfg.data, cfg.model, cfg.task, cfg.trainer)  # a dataset, a task: built small, or one line
    cfg, precision = resolve_precision(cfg)  # actor.mixed_precision / rollout.dtype auto: bf16 where it is faster
    if precision is not None:
        print(precision, file=out, flush=True)
    keep_freed_host_memory()  # CPU steps reuse their freed gradients' pages instead of faulting them in again
    check_installed(cfg.trainer.logger)  # a tracker named but not installed: one line naming the extra
    check_rollout_engine(cfg.rollout, cfg.model)  # the engine imports and runs here, or one line (vllm: `make vllm`)
    check_output_dir(cfg.trainer.output_dir)
    source = make_prompt_source(cfg)  # reads and checks any data files (one line naming what is wrong)
    plan = plan_run(cfg, source)  # the run resolved once: what the checks below read
    check_sequence_length(plan)
    memory = check_training_memory(plan)  # refused in one line if the run cannot fit
    print(memory.line(), file=out, flush=True)
    check_checkpoint_space(plan)  # a warning line only: the run may still free space or write fewer
    resume_point = find_resume_point(cfg.trainer) if cfg.trainer.resume else None
    if cfg.use_ray:
        probe_cluster(cfg.ray)  # an address that cannot be joined fails now, not after the ranks are placed
    ours = cfg.use_ray and not ray.is_initialized()  # a cluster we start (also half-way) we shut down
    try:
        if cfg.use_ray:
            init_ray(cfg.ray, cfg.rollout.num_threads)
            check_cluster_fits(cfg.trainer, cfg.rollout, cfg.ray)
        rollout = rollout_of(cfg, source) if rollout_of is not None else None
        try:
            trainer = ppo.PPOTrainer(
                cfg,
                rollout=rollout,
                source=source,
                resume_point=resume_point,
                pi_old_choice=plan.pi_old_choice,
                stop_after=stop_after,
            )
        except BaseException:
            if rollout is not None:
                rollout.close()
            raise
        print(trainer.actor_group.describe(), file=out, flush=True)
        if trainer.rollout is not None:  # started before the ranks (a fresh run's); else fit() makes it
            print(trainer.rollout.describe(), file=out, flush=True)
        try:
            (trainer.output_dir / "config.yaml").write_text(to_yaml(cfg))
        except BaseException:
            trainer.close()  # fit() never ran, so nothing else releases what the trainer built
            raise
        if trainer.resumed_from is not None:
            within = f", trigger {trainer.progress.trigger}" if trainer.progress.started else ""
            print(f"resumed from {trainer.resumed_from} (global step {trainer.global_step}{within})", file=out)
        result = trainer.fit()
    finally:
        if ours:
            shutdown_ray()
    print("\nsummary:", file=out)
    print(result.summary_table(), file=out)
    print(f"\nmetrics: {result.metrics_path}", file=out)
    if result.plot_path is not None:
        print(f"plot:    {result.plot_path}", file=out)
    print(f"summary: {result.summary_path}", file=out)
    if result.hf_model_path is not None:
        print(
            f"model:   {result.hf_model_path} (transformers; dppo eval {result.hf_model_path} --config "
            f"{result.output_dir / 'config.yaml'})",
            file=out,
        )
    if result.adapter_path is not None:
        print(
            f"adapter: {result.adapter_path} (PEFT; PeftModel.from_pretrained(base, {result.adapter_path}))", file=out
        )
    return result
