"""Checks `dppo train` makes before it builds the model or starts Ray: what would otherwise fail minutes later, and
the config's rules (dppo.config, pure checks of its values) cannot say without building or asking something. The
machine itself (the GPU, the CPUs, the model directory and the data files) is dppo.launch.machine's; the map of
every kind of check is dppo.config's docstring.

- the run's prompts can be made (check_prompt_source, `dppo eval` too): task.name's factory imports, a task leaves
  prompts to train on once its held-out eval prompts are drawn, a reasoning-gym dataset exists, takes its config
  and val_config and is installed (one item each built);
- the output directory can be created and written (OutputDirError), and has room for about two checkpoints
  (a warning line if not);
- the rollout engine rollout.name names imports, and its spec finds what it needs installed and on this machine;
- a prompt and a response fit the model's positions, and the run's memory fits the memory available: an
  estimate by process (each actor rank, each rollout worker, the driver, the replay buffer, the object store, Ray;
  dppo.launch.memory_estimate) counted from the config without allocating anything, printed in one line on every
  run; a run that cannot fit is a ConfigError giving the estimate by role and what to change;
- once Ray is up: the actor's ranks and the rollout's GPU workers fit the cluster's nodes together
  (PlacementError, with the counts), and on a cluster of the user's own the rollout workers' threads fit its
  CPUs (ConfigError).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from dppo.config import ConfigError
from dppo.config.checks import require, shown
from dppo.data.errors import MissingExtraError
from dppo.data.reasoning_gym import DatasetConfigError, UnknownDatasetError, make_dataset
from dppo.tasks import TASKS, PromptSampler, UnknownTaskError, held_out_prompts, make_task, task_exists
from dppo.launch import ray_cluster
from dppo.trainer import placement
from dppo.checkpoint.failure import checkpoint_bytes_estimate, free_bytes, size_in_words
from dppo.launch.memory_estimate import MemoryEstimate, estimate, what_to_change
from dppo.launch.plan import DTYPE_BYTES, RunPlan
from dppo.workers.rollout.engines import engine_spec

log = logging.getLogger("dppo.preflight")

GIB = 2**30


class OutputDirError(OSError):
    """trainer.output_dir cannot be created or written."""


def check_output_dir(path: str | os.PathLike) -> None:
    """OutputDirError unless path is (or can be made) a directory this process can write and fsync a file in."""
    directory = Path(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".dppo-write-check.", dir=directory)
        try:
            os.write(fd, b"dppo")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise OutputDirError(f"trainer.output_dir={str(path)!r} cannot be written: {reason}") from None


# ---- the model and the batches, from the run's plan -----------------------------------------------------


def check_sequence_length(plan: RunPlan) -> None:
    """ConfigError if prompt + response is longer than the model has positions for."""
    shape = plan.shape
    length = shape.prompt_length + shape.response_length
    if shape.max_positions is not None and length > shape.max_positions:
        raise ConfigError(
            f"a prompt of {shape.prompt_length} tokens ({plan.prompt_keys}) and a response of "
            f"{shape.response_length} (rollout.max_new_tokens, else the task's answer length) are "
            f"{length} positions, but the model has {shape.max_positions} (max_position_embeddings)"
        )


def check_checkpoint_space(plan: RunPlan) -> str | None:
    """One warning line (logged, and returned) if trainer.output_dir has less free space than about two
    checkpoints (the new one is written before retention deletes the oldest); None if it has room."""
    if plan.checkpoint_every == 0:
        return None
    needed = 2 * checkpoint_bytes_estimate(
        plan.shape.params, DTYPE_BYTES[plan.model_dtype], plan.reference_in_checkpoints
    )
    free = free_bytes(Path(plan.output_dir))
    if free >= needed:
        return None
    line = (
        f"trainer.output_dir={plan.output_dir!r} has {size_in_words(free)} free, less than two checkpoints "
        f"(about {size_in_words(needed)}): a checkpoint that cannot be written is a warning, two in a row stop "
        "the run (exit code 3)"
    )
    log.warning(line)
    return line


def batch_bytes(plan: RunPlan) -> tuple[int, int]:
    """Lower bounds of the memory of generating a batch (token ids, one step's logits, the KV cache) and of
    updating on a trigger's mini-batch (token ids, one micro-batch's logits and its saved layer outputs)."""
    shape, b, n = plan.shape, DTYPE_BYTES[plan.model_dtype], plan.rollout_n
    length = shape.prompt_length + shape.response_length
    generated = plan.groups_per_batch * n  # sequences a worker generates at once
    trigger = plan.groups_per_trigger * n  # sequences of one optimizer step
    micro = min(plan.micro_batch_size, trigger)
    generate = 8 * length * generated + b * generated * (shape.vocab_size + 2 * shape.layers * length * shape.kv_width)
    update = 8 * length * trigger + b * micro * (
        (shape.response_length + 1) * shape.vocab_size + shape.layers * length * shape.hidden
    )
    return generate, update


def available_host_bytes() -> int:
    """MemAvailable of /proc/meminfo, lowered to what a cgroup (v2) limit leaves; a large number if unknown."""
    available = 1 << 62
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return available


def _ranks_here(plan: RunPlan) -> int:
    """The actor's ranks on this machine: all of them in-process or on a local cluster, none (as far as this machine
    can tell) on a cluster of the user's own."""
    if not plan.use_ray:
        return 1
    return plan.world_size if plan.local_cluster else 0


def memory_estimate(plan: RunPlan) -> MemoryEstimate:
    """The host memory of the run on this machine, by role (dppo.launch.memory_estimate)."""
    return estimate(plan)


def check_training_memory(plan: RunPlan) -> MemoryEstimate:
    """The run's host memory estimate by role (its line() is printed on every run); ConfigError, in one line with
    the estimate by role and what to change, if it exceeds the memory available. With the actor on GPUs, also a
    lower bound of each GPU's share: a 1/world-size shard of the weights, gradients and Adam moments and an
    update's batch."""
    # the weights (LoRA: the base and the adapter) and the reference's copy of them; the gradients and 2 Adam moments
    # of the trainable ones (LoRA: the adapter's)
    model_bytes = plan.weight_bytes + plan.adapter_bytes
    trainer_bytes = model_bytes * (2 if plan.reference_in_checkpoints else 1) + 3 * plan.trainable_bytes
    what = f"{plan.shape.params:,} parameters in {plan.model_dtype}, {plan.model_keys}"
    if plan.trainer_on_gpu and _ranks_here(plan):
        _, update = batch_bytes(plan)
        free, _ = torch.cuda.mem_get_info()
        _require_fits(
            trainer_bytes // plan.world_size + update,
            free,
            what,
            "GPU",
            f"a 1/{plan.world_size} shard of the weights, gradients and Adam's two moments, an update's batch",
            "use a smaller model or smaller batches",
        )
    memory = memory_estimate(plan)
    by_role = ", ".join(f"{name} {b / GIB:.1f}" for name, b in memory.by_role().items() if b)
    _require_fits(
        memory.total_bytes,
        available_host_bytes(),
        what,
        "host",
        by_role,
        f"to make it fit: {what_to_change(plan)}; or use a smaller model",
    )
    return memory


def _require_fits(need: int, available: int, what: str, where: str, parts: str, change: str) -> None:
    if need > available:
        raise ConfigError(
            f"the run ({what}; batches from rollout.n, rollout.groups_per_batch, "
            f"trainer.train_batch_size, actor.micro_batch_size) needs about {need / GIB:,.1f} GiB of "
            f"{where} memory ({parts}), but {available / GIB:,.1f} GiB is available; {change}"
        )


# ---- a cluster of the user's own ----------------------------------------------------------------------


def check_cluster_fits(trainer, rollout, ray_cfg) -> None:
    """Once connected to Ray, before any rank or worker starts (the config's trainer, rollout and ray sections): the
    actor's and the rollout's pools fit the cluster's nodes together (PlacementError naming both pools and the
    counts); on a joined cluster (ray.address or RAY_ADDRESS) also the rollout workers' threads within its CPUs."""
    placement.pool_nodes(trainer, rollout)
    if not (ray_cfg.address or os.environ.get("RAY_ADDRESS")):
        return  # a local cluster: checked against this machine with the config

    r, cpus = rollout, ray_cluster.cluster_cpus()
    if r.num_workers * r.num_threads > cpus:
        raise ConfigError(
            f"rollout.num_workers={r.num_workers} with rollout.num_threads={r.num_threads}: "
            f"{r.num_workers * r.num_threads} worker threads, but the Ray cluster has {cpus:g} CPUs"
        )


def check_rollout_engine(rollout, model) -> None:
    """ConfigError, before anything starts, if rollout.name's engine cannot run here (the config's rollout and model
    sections): its module does not import (a class path of the user's own), or its spec says what is missing from
    this Python (vllm: `make vllm`) or what it cannot run on this machine (vllm: its GPU build without rollout GPUs,
    a head size its CPU kernels lack)."""
    spec = engine_spec(rollout.name)  # UnknownEngineError, EngineImportError, NotAnEngineError: ConfigErrors
    problem = spec.check_installed() or spec.check_setup(rollout, model)
    if problem is not None:
        raise ConfigError(problem)


# ---- the prompts: built once, small, before anything starts ---------------------------------------------------


def check_prompt_source(data, model, task, trainer) -> None:
    """ConfigError, in one line naming the key, where the run's prompts cannot be made (the config's data, model,
    task and trainer sections, which passed dppo.config's rules): task.name's factory does not import; a
    reasoning-gym dataset that does not exist, refuses its config or val_config, or is not installed (one item of
    each is built); a task whose held-out eval prompts would leave none to train on (drawn as the trainer will).
    What the config's rules cannot say without building them; `dppo train` and `dppo eval` ask before the output
    directory is made, so a bad dataset fails before anything starts, not in every worker after Ray is up."""
    require(
        task_exists(task.name),  # imports a module:function factory
        "task.name",
        task.name,
        "a registered task (" + ", ".join(TASKS) + ") or an importable module:function",
    )
    if data.kind == "reasoning_gym":
        _build_reasoning_gym(data.reasoning_gym, trainer.seed)
    elif data.kind == "task":
        _check_prompts_left_for_training(task, trainer)


def _build_reasoning_gym(rg, trainer_seed: int) -> None:
    """One item of the training dataset and of the held-out one (val_config), as the run will build them; imports
    reasoning-gym (about a second)."""
    seed, val_seed = rg.resolved_seeds(trainer_seed)
    key = "config"
    try:
        make_dataset(rg.dataset, rg.config, size=1, seed=seed)
        if rg.val_config is not None:
            key = "val_config"
            make_dataset(rg.dataset, rg.held_out_config, size=1, seed=val_seed)
    except UnknownDatasetError as err:
        raise ConfigError(f"data.reasoning_gym.dataset={rg.dataset!r}: {err}") from None
    except DatasetConfigError as err:
        raise ConfigError(f"data.reasoning_gym.{key}: {err}") from None
    except MissingExtraError as err:
        raise ConfigError(str(err)) from None


def _check_prompts_left_for_training(task_cfg, t) -> None:
    """The held-out eval prompts must leave the task prompts to train on (else every worker fails after Ray starts).

    Draws the held-out set exactly as the trainer will, then one training prompt as a worker would."""
    try:
        task = make_task(task_cfg.name, task_cfg.length)
        task.sample_prompts(np.random.default_rng(0), 1)  # a prompt of this length can be made at all
    except (UnknownTaskError, TypeError) as err:  # TypeError: the factory returned something other than a Task
        raise ConfigError(f"task.name={task_cfg.name!r}: {err}") from None
    except MemoryError:
        raise ConfigError(
            f"task.length={shown(task_cfg.length)}: a single prompt of task {task_cfg.name!r} cannot be allocated"
        ) from None
    if t.eval_prompts == 0:
        return
    where = f"task {task_cfg.name!r} with task.length={task_cfg.length}"
    if task.distinct_prompts is not None and t.eval_prompts >= task.distinct_prompts:  # counted, not drawn
        raise ConfigError(
            f"trainer.eval_prompts={shown(t.eval_prompts)}: {where} has only {task.distinct_prompts} distinct prompts, "
            f"and all would be held out for evaluation, none left to train on; lower trainer.eval_prompts below "
            f"{task.distinct_prompts} or raise task.length"
        )
    try:
        held_out = held_out_prompts(task, t.seed, t.eval_prompts)
    except MemoryError:
        raise ConfigError(
            f"trainer.eval_prompts={shown(t.eval_prompts)}: the held-out prompts cannot be allocated"
        ) from None
    if len(held_out) < t.eval_prompts:  # the task ran out of distinct prompts: all of them are held out
        raise ConfigError(
            f"trainer.eval_prompts={t.eval_prompts}: {where} has only {len(held_out)} distinct prompts, and all "
            f"would be held out for evaluation, none left to train on; lower trainer.eval_prompts below "
            f"{len(held_out)} or raise task.length"
        )
    try:
        PromptSampler(task, t.seed, held_out).sample(1)
    except RuntimeError:
        raise ConfigError(
            f"trainer.eval_prompts={t.eval_prompts} holds out (nearly) every distinct prompt of {where}: no "
            "training prompt could be drawn; lower trainer.eval_prompts or raise task.length"
        ) from None
