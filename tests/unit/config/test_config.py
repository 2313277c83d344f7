"""Config loading and validation: every bad setting fails before anything starts, naming key and value."""

import dataclasses
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from dppo.cli import config_help, main
from dppo.config import DEFAULTS_YAML, ConfigError, DppoConfig, describe, load_config, to_dict


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
        (["algorithm.rollout_correction.rollout_is=word"], ["rollout_is", "word"]),
        (["algorithm.rollout_correction.rollout_rs=token_k1"], ["rollout_rs_threshold"]),
        (
            ["trainer.train_batch_size=10", "trainer.parameter_sync_step=4"],
            ["train_batch_size=10", "parameter_sync_step=4"],
        ),
        (
            ["trainer.verify_old_log_prob=true", "algorithm.rollout_correction.bypass_mode=true"],
            ["verify_old_log_prob", "bypass_mode"],
        ),
        (["actor.loss_agg_mode=sum"], ["actor.loss_agg_mode", "sum", "token-mean"]),
        (["algorithm.prox_logp_method=exact"], ["algorithm.prox_logp_method", "exact", "'recompute', 'loglinear'"]),
        (
            ["algorithm.prox_logp_method=loglinear", "algorithm.rollout_correction.bypass_mode=true"],
            ["prox_logp_method=loglinear", "bypass_mode=true"],
        ),
        (
            ["algorithm.prox_logp_method=metrics", "algorithm.rollout_correction.bypass_mode=true"],
            ["prox_logp_method=metrics", "bypass_mode=true"],
        ),
        (
            ["algorithm.prox_logp_method=loglinear", "algorithm.prox_anchor=current"],
            ["prox_logp_method=loglinear", "prox_anchor=current"],
        ),
        (
            ["algorithm.prox_logp_method=metrics", "algorithm.prox_anchor=current"],
            ["prox_logp_method=metrics", "prox_anchor=current"],
        ),
        (
            ["algorithm.prox_logp_method=loglinear", "algorithm.rollout_correction.rollout_is_batch_normalize=true"],
            ["prox_logp_method=loglinear", "rollout_is_batch_normalize=true"],
        ),
        (
            ["algorithm.prox_logp_method=auto", "snapshot.strategy=reference"],
            ["prox_logp_method=auto", "snapshot.strategy='reference'", "snapshot.strategy=auto"],
        ),
        (
            ["algorithm.prox_logp_method=loglinear", "trainer.verify_old_log_prob=true"],
            ["verify_old_log_prob=true", "prox_logp_method=loglinear", "prox_logp_method=metrics"],
        ),
        (["trainer.total_steps"], ["key=value"]),
        (["trainer=3"], ["trainer is a config section"]),
        (["algorithm.rollout_correction=x"], ["algorithm.rollout_correction is a config section"]),
        (["algorithm.rollout_correction.rollout_is_batch_normalize=maybe"], ["rollout_is_batch_normalize", "maybe"]),
        (["trainer.seed=-1"], ["trainer.seed=-1", "[0, 2**64)"]),
        (["ray.num_cpus=0"], ["ray.num_cpus=0"]),
        (["ray.num_cpus=-1"], ["ray.num_cpus=-1"]),
        (["trainer.nnodes=0"], ["trainer.nnodes=0"]),
        (["trainer.n_gpus_per_node=0"], ["trainer.n_gpus_per_node=0"]),
        (["trainer.collective_timeout_s=inf"], ["trainer.collective_timeout_s=inf"]),
        (["actor.fsdp=never"], ["actor.fsdp", "never", "'auto', 'always'"]),
        # a sharded actor refuses the readers FSDP2 would bypass, naming the ones that work
        (
            ["trainer.n_gpus_per_node=2", "snapshot.strategy=view"],
            [
                "snapshot.strategy='view' is not exact on a sharded (FSDP2) actor",
                "auto, swap, reference",
                "world size 2",
            ],
        ),
        (["trainer.nnodes=2", "snapshot.strategy=stream"], ["snapshot.strategy='stream'", "auto, swap, reference"]),
        (["actor.fsdp=always", "snapshot.strategy=view"], ["snapshot.strategy='view'", "actor.fsdp='always'"]),
        (
            ["trainer.n_gpus_per_node=2", "ray.enabled=false", "trainer.mode=sync"],
            ["trainer.n_gpus_per_node=2", "ray.enabled=false runs one rank"],
        ),
        (
            ["model.lora_rank=8", "rollout.weight_sync=delta"],
            ["model.lora_rank=8", "rollout.weight_sync=delta", "adapter alone", "rollout.weight_sync=full"],
        ),
    ],
)
def test_bad_settings_raise_config_error_naming_key_and_value(override, fragments):
    with pytest.raises(ConfigError) as info:
        load_config(override)
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize("lora_rank, weight_sync", [(8, "full"), (0, "delta")])
def test_lora_takes_full_syncs_and_delta_syncs_take_a_whole_model(lora_rank, weight_sync):
    """The rule against model.lora_rank with rollout.weight_sync=delta refuses that pair alone."""
    cfg = load_config([f"model.lora_rank={lora_rank}", f"rollout.weight_sync={weight_sync}"])
    assert (cfg.model.lora_rank, cfg.rollout.weight_sync) == (lora_rank, weight_sync)


def test_building_a_config_probes_nothing_of_the_machine(tmp_path, monkeypatch):
    """A config is plain data: a model directory, data files, a GPU or the CPUs it names are dppo.launch.machine's to
    check (tests/unit/launch/test_machine.py), not load_config's."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("load_config asked for a GPU"))
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    cfg = load_config(
        [f"model.path={tmp_path}/none", "trainer.device=cuda", "trainer.num_threads=100000", "ray.enabled=null"]
    )
    assert (cfg.model.path, cfg.trainer.device, cfg.trainer.num_threads) == (f"{tmp_path}/none", "cuda", 100000)
    assert cfg.use_ray  # trainer.device=cuda asks for Ray by the config's own rule; RAY_ADDRESS is not read here


def test_config_file_then_overrides(tmp_path):
    path = tmp_path / "my.yaml"
    path.write_text("trainer:\n  total_steps: 7\n  seed: 3\n")
    cfg = load_config(["trainer.seed=5"], config_file=path)
    assert (cfg.trainer.total_steps, cfg.trainer.seed) == (7, 5)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config([], config_file=tmp_path / "missing.yaml")


@pytest.mark.parametrize("loss_type", ["reinforce", "ppo_clip"])
def test_bypass_mode_takes_rejection_sampling_with_either_loss(loss_type):
    # Regression: ppo_clip with rollout_rs was a ConfigError; verl's bypass loss applies the rejection mask there.
    key = "algorithm.rollout_correction"
    cfg = load_config(
        [
            f"{key}.bypass_mode=true",
            f"{key}.loss_type={loss_type}",
            f"{key}.rollout_rs=token_k1",
            f"{key}.rollout_rs_threshold=2.0",
            f"{key}.rollout_is_batch_normalize=true",
        ]
    )
    rc = cfg.algorithm.rollout_correction.to_algo()
    assert rc.rs_bounds["token_k1"] == (0.5, 2.0) and rc.rollout_is_batch_normalize is True


@pytest.mark.parametrize(
    "text, fragments",
    [
        ("- 1\n- 2\n", ["expected a mapping of config sections", "got a list"]),
        ("7\n", ["not a YAML mapping"]),
        ("trainer: [1\n", ["not a YAML mapping", "line 1"]),
        ("trainer: 3\n", ["trainer: 3 is a value, but trainer is a config section", "trainer.total_steps"]),
        ("trainer:\n", ["trainer: null is a value"]),
        ("algorithm:\n  rollout_correction: 5\n", ["algorithm.rollout_correction: 5 is a value"]),
        ("trainer:\n  total_steps: many\n", ["trainer.total_steps", "many"]),
        ("trainer:\n  nope: 1\n", ["unknown config key 'trainer.nope'"]),
    ],
    ids=[
        "list",
        "scalar",
        "bad-yaml",
        "section-scalar",
        "section-null",
        "subsection-scalar",
        "bad-type",
        "unknown-key",
    ],
)
def test_a_bad_config_file_fails_with_one_line_naming_the_file_and_key(tmp_path, capsys, text, fragments):
    path = tmp_path / "my.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config([], config_file=path)
    for fragment in [f"config file '{path}'", *fragments]:
        assert fragment in str(info.value), str(info.value)
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dppo: error: config file") and err.count("\n") == 1, err


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
    out = subprocess.run([sys.executable, "-m", "dppo", "train", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "trainer.parameter_sync_step = 4" in out.stdout
    assert "replay.max_off_policy_strategy = wait" in out.stdout
