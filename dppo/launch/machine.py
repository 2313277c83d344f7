"""What the config alone cannot say, asked of this machine once, before anything starts: whether it has a GPU, how many
CPUs, whether the files the config names exist, and the Ray cluster an environment variable names. The config itself
(dppo.config) is plain data: building one probes nothing.

    cfg = resolve_ray(cfg)    ray.enabled=null decided with RAY_ADDRESS and the GPU (the rest of the rule is pure)
    check_machine(cfg)        ConfigError (exit 2) or DataFileError (exit 6), one line naming the key and value
"""

from __future__ import annotations

import dataclasses
import os

import torch

from dppo.config import ConfigError, DppoConfig
from dppo.config.checks import require, shown
from dppo.data.errors import DataFileError


def machine_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def at_most_cpus(key: str, value: int) -> None:
    cpus = machine_cpus()
    require(value <= cpus, key, value, f"at most the {cpus} CPUs of this machine")


def ray_address_in_environment() -> str | None:
    return os.environ.get("RAY_ADDRESS") or None


def resolve_ray(cfg: DppoConfig) -> DppoConfig:
    """cfg with ray.enabled=null decided where only the machine can: a cluster named by RAY_ADDRESS, or a GPU under
    trainer.device=auto, runs on Ray (the config's own rule, DppoConfig.use_ray, covers the keys)."""
    if cfg.ray.enabled is not None:
        return cfg
    on_gpu = cfg.trainer.device == "auto" and torch.cuda.is_available()
    if not (ray_address_in_environment() or on_gpu):
        return cfg
    return dataclasses.replace(cfg, ray=dataclasses.replace(cfg.ray, enabled=True))


def check_machine(cfg: DppoConfig) -> None:
    """The config against this machine: the GPU trainer.device names, the CPUs the threads need, the model
    directory and the data and reward files."""
    t = cfg.trainer
    if t.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "trainer.device='cuda': expected cpu or auto (torch.cuda.is_available() is False on this machine)"
        )
    at_most_cpus("trainer.num_threads", t.num_threads)
    if cfg.use_ray or t.mode != "sync":  # else the rollout runs inside the trainer's process
        joined = cfg.use_ray and bool(cfg.ray.address or ray_address_in_environment())
        _check_local_workers_fit(cfg.rollout, joined)
    path = cfg.model.path
    if path is not None and not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(
            f"model.path={path!r}: expected an existing local transformers model directory (one holding config.json)"
        )
    for key, files in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
        for file in [] if files is None else [files] if isinstance(files, str) else files:
            if not os.path.isfile(file):  # a missing file is a data error (exit code 6), as an unreadable one is
                raise DataFileError(f"{key}={shown(files)}: data file {file!r} does not exist")
    reward = cfg.custom_reward_function.path
    if reward is not None and not os.path.isfile(reward):
        raise DataFileError(f"custom_reward_function.path={reward!r}: the reward function's file does not exist")


def _check_local_workers_fit(r, joined: bool) -> None:
    """On a local Ray cluster, or as local processes, every rollout worker runs on this machine: their threads (r: the
    config's rollout section) must fit its CPUs; on a cluster of your own (joined), dppo.launch.run checks the
    cluster's CPUs once it has joined."""
    if joined:
        return
    cpus = machine_cpus()
    if r.num_workers * r.num_threads > cpus:
        raise ConfigError(
            f"rollout.num_workers={shown(r.num_workers)} with rollout.num_threads={r.num_threads}: "
            f"{r.num_workers * r.num_threads} worker threads, but this machine has {cpus} CPUs (every rollout worker "
            "runs here); lower them, or join a larger cluster with ray.address"
        )
