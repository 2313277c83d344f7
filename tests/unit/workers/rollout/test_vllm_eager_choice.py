"""rollout.enforce_eager (verl's key): which vllm engines compile. null: eager on the CPU (compiling costs 40-65 s
per engine start there), compiled on a GPU (CUDA graphs, vLLM's own default); true or false as set."""

import pytest
import torch

from dppo.workers.rollout.engines.vllm import enforce_eager


@pytest.mark.parametrize("setting, device, eager", [
    (None, "cpu", True), (None, "cuda", False),
    (True, "cpu", True), (True, "cuda", True),
    (False, "cpu", False), (False, "cuda", False),
])  # fmt: skip
def test_null_is_eager_on_the_cpu_only_and_a_setting_wins(small_cfg, setting, device, eager):
    cfg = small_cfg(**{"rollout.name": "vllm", "rollout.enforce_eager": setting})
    assert cfg.rollout.enforce_eager is setting
    assert enforce_eager(cfg.rollout.enforce_eager, torch.device(device)) is eager


def test_a_value_that_is_not_a_bool_is_refused_in_one_line(small_args, capsys):
    from dppo.cli import main

    assert main(["train", *small_args(**{"rollout.enforce_eager": "sometimes"})]) == 2
    err = capsys.readouterr().err
    assert "rollout.enforce_eager" in err and "sometimes" in err and len(err.strip().splitlines()) == 1
