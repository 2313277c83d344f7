"""dppo.launch.machine: what the config cannot know, asked of the machine once before a run starts (a GPU, the CPUs,
the model directory, the data files, RAY_ADDRESS), each a one-line error naming the key and the value."""

import pytest
import torch

from dppo.config import ConfigError, load_config
from dppo.launch.machine import check_machine, resolve_ray


def test_a_directory_without_a_model_and_cuda_without_a_gpu_are_config_errors(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=rf"model.path='{tmp_path}': expected .*config.json"):
        check_machine(load_config([f"model.path={tmp_path}"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"trainer.device='cuda': expected cpu or auto .*is_available\(\) is False"):
        check_machine(load_config(["trainer.device=cuda"]))
    with pytest.raises(ConfigError, match=r"trainer.num_threads=100000: expected at most the \d+ CPUs of this machine"):
        check_machine(load_config(["trainer.num_threads=100000"]))
    check_machine(load_config([]))  # the defaults fit any machine


def test_ray_enabled_null_is_decided_with_ray_address_and_the_gpu(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    auto = load_config(["ray.enabled=null"])
    assert resolve_ray(auto) is auto and not auto.use_ray  # one CPU machine: no Ray
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    resolved = resolve_ray(auto)
    assert resolved.ray.enabled is True and resolved.use_ray and auto.ray.enabled is None  # a new config
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_ray(auto).use_ray  # a GPU under trainer.device=auto
    assert not resolve_ray(load_config(["ray.enabled=false"])).use_ray  # an explicit choice stands
