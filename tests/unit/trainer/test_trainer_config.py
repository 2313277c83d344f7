"""Config loading and validation: every bad setting fails before anything starts, naming key and value."""

import dataclasses
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from dppo.cli import config_help, main
from dppo.trainer.config import DEFAULTS_YAML, ConfigError, DppoConfig, describe, load_config, to_dict


def test_shipped_yaml_is_complete_and_equals_the_dataclass_defaults():
    # The YAML is what `dppo train` runs; the dataclass defaults are what library users get. They must agree,
    # and the YAML must name every key (so it documents the whole config).
    yaml = OmegaConf.to_container(OmegaConf.load(DEFAULTS_YAML))
    assert yaml == to_dict(DppoConfig())


def test_defaults_are_the_demo_setup():
    cfg = load_config()
    assert cfg.trainer.mode == "separate_async"
    assert cfg.algorithm.rollout_correction.bypass_mode is False
    assert cfg.algorithm.prox_anchor == "cycle_start"
    assert cfg.trainer.parameter_sync_step == 4
    assert cfg.rollout.num_workers == 1
    assert cfg.task.name == "copy"
    assert cfg.groups_per_trigger * cfg.trainer.parameter_sync_step == cfg.trainer.train_batch_size


def test_overrides_are_typed_and_nested():
    cfg = load_config(["actor.lr=3e-4", "algorithm.rollout_correction.rollout_is=token", "rollout.max_new_tokens=7"])
    assert cfg.actor.lr == 3e-4
    assert cfg.algorithm.rollout_correction.rollout_is == "token"
    assert cfg.rollout.max_new_tokens == 7
    assert cfg.algorithm.rollout_correction.to_algo().rollout_is == "token"


@pytest.mark.parametrize(
    "override, fragments",
    [
        (["actor.nope=1"], ["actor.nope", "lr"]),  # unknown key: named, valid siblings listed
        (["nosection.x=1"], ["nosection"]),
        (["actor.lr=fast"], ["actor.lr", "fast"]),  # wrong type
        (["trainer.resume=maybe"], ["trainer.resume", "maybe"]),
        (["trainer.total_steps=0"], ["trainer.total_steps=0"]),
        (["trainer.mode=turbo"], ["trainer.mode", "turbo", "separate_async"]),
        (["algorithm.adv_estimator=ppo"], ["algorithm.adv_estimator", "ppo", "grpo"]),
        (["algorithm.prox_anchor=middle"], ["algorithm.prox_anchor", "middle"]),
        (["snapshot.strategy=fast"], ["snapshot.strategy", "fast", "'auto', 'view', 'swap', 'stream', 'reference'"]),
        (["replay.max_off_policy_strategy=keep"], ["replay.max_off_policy_strategy", "keep"]),
        (["rollout.n=1"], ["rollout.n=1"]),
        (["task.name=nosuchtask"], ["task.name", "nosuchtask", "copy"]),
        (["model.hidden_size=30", "model.num_attention_heads=4"], ["model.hidden_size=30"]),
        (["model.path=/no/such/dir"], ["model.path", "/no/such/dir"]),
        (["algorithm.rollout_correction.rollout_is=word"], ["rollout_is", "word"]),
        (["algorithm.rollout_correction.rollout_rs=token_k1"], ["rollout_rs_threshold"]),
        (["trainer.train_batch_size=10", "trainer.parameter_sync_step=4"], ["train_batch_size=10", "parameter_sync_step=4"]),
        (["ray.enabled=false"], ["ray.enabled=false", "trainer.mode"]),
        (["trainer.verify_old_log_prob=true", "algorithm.rollout_correction.bypass_mode=true"], ["verify_old_log_prob", "bypass_mode"]),
        (["actor.loss_agg_mode=sum"], ["actor.loss_agg_mode", "sum", "token-mean"]),
        (["trainer.total_steps"], ["key=value"]),
        (["trainer=3"], ["trainer is a config section"]),
        (["algorithm.rollout_correction=x"], ["algorithm.rollout_correction is a config section"]),
    ],
)
def test_bad_settings_raise_config_error_naming_key_and_value(override, fragments):
    with pytest.raises(ConfigError) as info:
        load_config(override)
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message


def test_a_directory_without_a_model_and_cuda_without_a_gpu_fail_as_config_errors(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=rf"model.path='{tmp_path}': expected .*config.json"):
        load_config([f"model.path={tmp_path}"])
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"trainer.device='cuda': expected cpu or auto .*is_available\(\) is False"):
        load_config(["trainer.device=cuda"])


def test_config_file_then_overrides(tmp_path):
    path = tmp_path / "my.yaml"
    path.write_text("trainer:\n  total_steps: 7\n  seed: 3\n")
    cfg = load_config(["trainer.seed=5"], config_file=path)
    assert (cfg.trainer.total_steps, cfg.trainer.seed) == (7, 5)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config([], config_file=tmp_path / "missing.yaml")


def test_every_leaf_key_is_documented_and_listed_in_help():
    rows = describe()
    leaves = []

    def walk(obj, prefix):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, prefix + f.name + ".")
            else:
                leaves.append(prefix + f.name)

    walk(DppoConfig(), "")
    assert [key for key, _, _ in rows] == leaves
    text = config_help()
    for key, default, doc in rows:
        assert doc, f"{key} has no docstring"
        assert f"{key} = " in text
    assert "trainer.parameter_sync_step = 4" in text
    assert "algorithm.rollout_correction.bypass_mode = false" in text


def test_cli_prints_one_line_error_and_exits_2(capsys):
    assert main(["train", "trainer.parameter_sync_step=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert err.startswith("dppo: error: trainer.train_batch_size=") and "parameter_sync_step=3" in err


def test_cli_show_config(capsys):
    assert main(["train", "--show-config", "trainer.seed=9"]) == 0
    out = capsys.readouterr().out
    assert "seed: 9" in out and "parameter_sync_step: 4" in out


def test_python_m_dppo_train_help_lists_the_config():
    out = subprocess.run([sys.executable, "-m", "dppo.train", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "trainer.parameter_sync_step = 4" in out.stdout
    assert "replay.max_off_policy_strategy = wait" in out.stdout
