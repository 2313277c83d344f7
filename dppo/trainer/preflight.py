"""Checks `dppo train` makes before it builds the model or starts Ray: what would otherwise fail minutes later.

- the output directory can be created and written (OutputDirError);
- the model's training memory (weights, gradients, Adam's two moments, a snapshot slot, the rollout copies on
  this machine) fits the memory available, counted from the config without allocating anything (ConfigError);
- on a Ray cluster of the user's own, the rollout workers' threads fit the cluster's CPUs (ConfigError).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from dppo.trainer.config import ConfigError, DppoConfig

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


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


# ---- memory ------------------------------------------------------------------------------------------


def tiny_model_parameters(vocab_size: int, hidden: int, layers: int, intermediate: int) -> int:
    """Parameters of dppo.models' tiny Qwen2 (untied embeddings, q/k/v biases, as many key/value heads as heads)."""
    per_layer = 4 * hidden * hidden + 3 * hidden + 3 * hidden * intermediate + 2 * hidden  # attention, MLP, 2 norms
    return 2 * vocab_size * hidden + layers * per_layer + hidden  # embeddings, lm_head, layers, final norm


def model_parameters(cfg: DppoConfig, vocab_size: int) -> int:
    """Parameters of the model cfg describes, counted without allocating it (model.path: built on the meta device)."""
    m = cfg.model
    if m.path is None:
        return tiny_model_parameters(vocab_size, m.hidden_size, m.num_hidden_layers, m.intermediate_size)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(m.path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


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


def _rollout_copies_here(cfg: DppoConfig) -> int:
    """Model copies the rollout keeps on this machine: the in-process generator's, or every worker's on a local cluster."""
    if not cfg.ray.enabled:
        return 1
    local = not (cfg.ray.address or os.environ.get("RAY_ADDRESS"))
    return cfg.rollout.num_workers if local else 0


def check_training_memory(cfg: DppoConfig, vocab_size: int) -> None:
    """ConfigError if the model cannot be trained in the memory available (a lower bound: no activations)."""
    from dppo.trainer.prox import select_strategy_name

    params = model_parameters(cfg, vocab_size)
    copy_bytes = params * DTYPE_BYTES[cfg.model.dtype]
    trainer_copies = 4 + (1 if cfg.actor.kl_loss_coef > 0 else 0)  # weights, grads, 2 Adam moments (+ KL reference)
    snapshot = 1 if select_strategy_name(cfg).startswith("cycle_start") else 0
    rollout = _rollout_copies_here(cfg)
    on_gpu = _trainer_on_gpu(cfg)
    host_copies = snapshot + rollout + (0 if on_gpu else trainer_copies)
    what = (f"{params:,} parameters in {cfg.model.dtype}, {_model_keys(cfg)}")
    if on_gpu:
        import torch

        free, _ = torch.cuda.mem_get_info()
        _require_fits(trainer_copies * copy_bytes, free, what, "GPU", "weights, gradients and Adam's two moments")
    parts = ("weights, gradients and Adam's two moments, " if not on_gpu else "") + \
        f"{snapshot} snapshot slot(s) and {rollout} rollout model copies"  # fmt: skip
    _require_fits(host_copies * copy_bytes, available_host_bytes(), what, "host", parts)


def _trainer_on_gpu(cfg: DppoConfig) -> bool:
    if cfg.trainer.device == "cpu":
        return False
    import torch

    return torch.cuda.is_available()


def _model_keys(cfg: DppoConfig) -> str:
    m = cfg.model
    if m.path is not None:
        return f"model.path={m.path!r}"
    return (f"model.hidden_size={m.hidden_size}, model.num_hidden_layers={m.num_hidden_layers}, "
            f"model.intermediate_size={m.intermediate_size}")  # fmt: skip


def _require_fits(need: int, available: int, what: str, where: str, parts: str) -> None:
    if need > available:
        raise ConfigError(f"the model ({what}) needs at least {need / GIB:,.1f} GiB of {where} memory to train "
                          f"({parts}), but {available / GIB:,.1f} GiB is available; use a smaller model")  # fmt: skip


# ---- a cluster of the user's own ----------------------------------------------------------------------


def check_cluster_fits(cfg: DppoConfig) -> None:
    """On a joined cluster (ray.address or RAY_ADDRESS): the rollout workers' threads within its CPUs."""
    if not (cfg.ray.address or os.environ.get("RAY_ADDRESS")):
        return  # a local cluster: checked against this machine with the config
    from dppo.trainer.ray_cluster import cluster_cpus

    r, cpus = cfg.rollout, cluster_cpus()
    if r.num_workers * r.num_threads > cpus:
        raise ConfigError(f"rollout.num_workers={r.num_workers} with rollout.num_threads={r.num_threads}: "
                          f"{r.num_workers * r.num_threads} worker threads, but the Ray cluster has {cpus:g} CPUs")  # fmt: skip
