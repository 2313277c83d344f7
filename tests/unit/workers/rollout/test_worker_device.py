"""A rollout worker's device: the GPU Ray gave it (as cuda:0 of its process), else the CPU; never the CPU unnoticed
when it was given a GPU its torch cannot use. (The CUDA run of a worker is tests/cuda/test_rollout_worker_cuda.py.)"""

import pytest
import torch

from dppo.workers.rollout.ray_worker import worker_device


def test_no_gpu_is_the_cpu():
    assert worker_device(0, [], cuda_available=True) == torch.device("cpu")
    assert worker_device(0, [], cuda_available=False) == torch.device("cpu")


def test_a_gpu_from_ray_is_cuda_0_of_the_process():
    # Ray's CUDA_VISIBLE_DEVICES shows the worker its own GPU only, whichever id it has on the node.
    assert worker_device(1, [3], cuda_available=True) == torch.device("cuda", 0)
    assert worker_device(1, ["5"], cuda_available=True) == torch.device("cuda", 0)


def test_a_gpu_torch_cannot_use_is_an_error_naming_it(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(
        RuntimeError,
        match=r"rollout worker 2 was given GPU\(s\) \['3'\] by Ray, but "
        r"torch.cuda.is_available\(\) is False .*CUDA_VISIBLE_DEVICES='3'",
    ):
        worker_device(2, [3], cuda_available=False)
