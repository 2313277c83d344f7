"""The pre-flight memory check of a sharded actor: each GPU holds a 1/world-size shard of the weights, gradients and
Adam moments, and ranks on a cluster of the user's own take nothing from this machine's host memory."""

import dataclasses

import pytest
import torch

from dppo.data import make_prompt_source
from dppo.launch import preflight
from dppo.launch.plan import plan_run
from dppo.config import ConfigError
from dppo.launch.memory_estimate import PROCESS_BYTES

GIB = 2**30


def plan_and_bytes(cfg, **resolved):
    plan = dataclasses.replace(plan_run(cfg, make_prompt_source(cfg)), **resolved)
    return plan, plan.shape.params * 4  # fp32


@pytest.mark.parametrize("world_size, fits", [(1, False), (4, True)])
def test_a_model_too_large_for_one_gpu_fits_when_sharded(small_cfg, monkeypatch, world_size, fits):
    cfg = small_cfg(
        **{
            "model.hidden_size": 512,
            "model.intermediate_size": 2048,
            "model.num_hidden_layers": 8,
            "trainer.n_gpus_per_node": world_size,
            "ray.enabled": True,
            "trainer.mode": "sync",
        }
    )
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    plan, copy_bytes = plan_and_bytes(cfg, trainer_on_gpu=True)
    _, update = preflight.batch_bytes(plan)
    free = 2 * copy_bytes + update  # half of weights + grads + 2 Adam moments: a quarter of them fits
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (free, 8 * free))
    monkeypatch.setattr(preflight, "available_host_bytes", lambda: 1 << 50)
    if fits:
        preflight.check_training_memory(plan)
    else:
        with pytest.raises(ConfigError, match=r"GiB of GPU memory \(a 1/1 shard of the weights"):
            preflight.check_training_memory(plan)


@pytest.mark.parametrize("address, fits", [(None, False), ("10.0.0.7:6379", True)])
def test_ranks_on_a_cluster_of_ones_own_take_no_host_memory_here(small_cfg, monkeypatch, address, fits):
    cfg = small_cfg(
        **{
            "model.hidden_size": 512,
            "model.intermediate_size": 2048,
            "model.num_hidden_layers": 8,
            "trainer.n_gpus_per_node": 2,
            "ray.enabled": True,
            "trainer.mode": "sync",
            "ray.address": address,
            "trainer.device": "cpu",
            "rollout.num_workers": 1,
        }
    )
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    plan, copy_bytes = plan_and_bytes(cfg)
    # less than the actor's 5 copies, more than the driver's process and its policy copy
    monkeypatch.setattr(preflight, "available_host_bytes", lambda: 3 * copy_bytes + PROCESS_BYTES)
    if fits:
        preflight.check_training_memory(plan)  # the ranks (and the rollout workers) are elsewhere
    else:
        with pytest.raises(ConfigError, match="GiB of host memory"):
            preflight.check_training_memory(plan)
