"""Checks `dppo train` makes before it builds the model or starts Ray: what would otherwise fail minutes later.

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

import torch

from dppo.config import ConfigError
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
    trainer_copies = 4 + (1 if plan.reference_in_checkpoints else 0)  # weights, grads, 2 Adam moments (+ reference)
    what = f"{plan.shape.params:,} parameters in {plan.model_dtype}, {plan.model_keys}"
    if plan.trainer_on_gpu and _ranks_here(plan):
        _, update = batch_bytes(plan)
        free, _ = torch.cuda.mem_get_info()
        _require_fits(
            trainer_copies * plan.weight_bytes // plan.world_size + update,
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
