"""`dppo train`'s own errors: one line each, a distinct exit code, before anything starts; a traceback only with
--debug (or DPPO_DEBUG=1), and for unexpected errors."""

import pytest

from dppo.cli import EXIT_CODES, main


@pytest.fixture
def run_cli(small_args, capsys):
    """run_cli(*flags, **{"dotted.key": value}) -> (exit code, stderr lines) of `dppo train` on small_cfg's settings."""

    def run(*flags: str, **overrides) -> tuple[int, list[str]]:
        code = main(["train", *small_args(**overrides), *flags])
        return code, capsys.readouterr().err.strip().splitlines()

    return run


def one_error_line(lines: list[str]) -> str:
    """The single `dppo: error:` line, which must be the last line of stderr, with no traceback anywhere."""
    errors = [line for line in lines if line.startswith("dppo: error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], lines
    assert not any("Traceback" in line for line in lines), lines
    return errors[0]


@pytest.mark.parametrize(
    "override, fragments",
    [
        ({"rollout.temperature": "inf"}, ["rollout.temperature=inf", "finite"]),
        ({"actor.lr": "inf"}, ["actor.lr=inf", "finite"]),
        ({"actor.grad_clip": "inf"}, ["actor.grad_clip=inf", "finite"]),
        ({"actor.weight_decay": "inf"}, ["actor.weight_decay=inf", "finite"]),
        ({"actor.lr": "nan"}, ["actor.lr=nan"]),
        ({"snapshot.device_budget_bytes": 10**23}, ["snapshot.device_budget_bytes=100000000000000000000000", "int64"]),
        ({"snapshot.device_budget_bytes": "1e23"}, ["snapshot.device_budget_bytes", "1e+23"]),
        ({"trainer.total_steps": 10**400}, ["trainer.total_steps=", "(401 characters)", "int64"]),
        (
            {"rollout.num_workers": 100_000, "ray.enabled": True, "trainer.mode": "separate_async"},
            ["rollout.num_workers=100000", "CPUs"],
        ),
        ({"trainer.num_threads": 100_000}, ["trainer.num_threads=100000", "CPUs of this machine"]),
        ({"rollout.max_restarts": -1}, ["rollout.max_restarts=-1"]),
        # 4.4e12 parameters: refused from the config's numbers, before anything is allocated
        ({"model.hidden_size": 2**20}, ["model.hidden_size=1048576", "GiB of host memory", "use a smaller model"]),
        ({"rollout.n": 10**8}, ["rollout.n", "GiB of host memory", "smaller batches"]),  # the batches' KV caches
        ({"rollout.max_new_tokens": 300}, ["a response of 300", "305 positions", "has 256 (max_position_embeddings)"]),
        ({"task.length": 10**12}, ["task.length=1000000000000: a single prompt of task 'copy' cannot be allocated"]),
        ({"trainer.eval_prompts": 10**12}, ["trainer.eval_prompts=1000000000000: task 'copy'", "only 1000 distinct"]),
        # once crashed at rank start (UnknownStrategyError: unknown slot reader 'reference')
        (
            {"algorithm.prox_logp_method": "auto", "snapshot.strategy": "reference"},
            ["algorithm.prox_logp_method=auto", "snapshot.strategy='reference'"],
        ),
    ],
)
def test_each_config_error_is_one_line_with_exit_code_2(run_cli, override, fragments):
    code, lines = run_cli(**override)
    line = one_error_line(lines)
    assert code == 2
    for fragment in fragments:
        assert fragment in line, line
    assert len(line) < 600  # no tensor, no 400-digit number


def test_an_output_directory_that_cannot_be_written_is_exit_code_3(run_cli, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    code, lines = run_cli(**{"trainer.output_dir": blocker / "run"})
    assert code == 3
    assert (
        one_error_line(lines)
        == f"dppo: error: trainer.output_dir='{blocker / 'run'}' cannot be written: Not a directory"
    )


def test_checkpoints_that_do_not_fit_are_named_then_exit_code_4(run_cli, tmp_path):
    assert run_cli(**{"trainer.checkpoint_every": 1, "algorithm.prox_anchor": "current"})[0] == 0
    code, lines = run_cli(**{"trainer.resume": True, "model.hidden_size": 48})
    assert code == 4
    warnings = [line for line in lines if line.startswith("dppo: warning: skipped checkpoint ")]
    assert [w.split(":")[2] for w in warnings] == [
        f" skipped checkpoint {tmp_path}/run/checkpoints/step_0000000{i}" for i in (2, 1)
    ]
    assert all(len(w.split(": ", 3)[3]) <= 300 for w in warnings)  # the reason is cut short, not every shape
    assert "no usable checkpoint" in one_error_line(lines)


def test_a_rollout_failure_is_one_line_exit_code_1_after_a_checkpoint(run_cli, tmp_path, monkeypatch):
    from dppo.trainer.rollout import InProcessRollout, RolloutFailedError

    def dead(self, num_groups, trainer_version):
        if trainer_version == 1:
            raise RolloutFailedError("the replay buffer died")
        return fetch(self, num_groups, trainer_version)

    fetch = InProcessRollout.fetch
    monkeypatch.setattr(InProcessRollout, "fetch", dead)
    code, lines = run_cli(**{"trainer.checkpoint_every": 5, "trainer.total_steps": 3})
    assert code == 1
    assert one_error_line(lines) == (
        "dppo: error: the replay buffer died; the trainer's state at step 1 is "
        f"checkpointed in {tmp_path}/run/checkpoints/step_00000001 (trainer.resume=true "
        "continues from it)"
    )


def test_debug_adds_the_traceback_and_keeps_the_exit_code(run_cli, monkeypatch):
    monkeypatch.setenv("DPPO_DEBUG", "1")
    code, lines = run_cli(**{"actor.lr": "inf"})
    assert code == 2 and lines[0].startswith("Traceback") and lines[-1].startswith("dppo: error: actor.lr=inf")
    monkeypatch.delenv("DPPO_DEBUG")
    code, lines = run_cli("--debug", **{"actor.lr": "inf"})
    assert code == 2 and lines[0].startswith("Traceback")


def test_an_unexpected_error_keeps_its_traceback_and_is_exit_code_70(run_cli, monkeypatch):
    import dppo.launch.run

    monkeypatch.setattr(dppo.launch.run, "run", lambda cfg: 1 / 0)
    code, lines = run_cli()
    assert code == 70 and lines[0].startswith("Traceback") and lines[-1].startswith("dppo: internal error: ZeroDiv")


def test_the_exit_codes_are_distinct_and_documented():
    codes = [code for code, _ in EXIT_CODES]
    assert len(set(codes)) == len(codes)
    from pathlib import Path

    section = (Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md").read_text()
    for code, _ in EXIT_CODES:
        assert f"| {code} |" in section, code


def test_a_cluster_of_your_own_must_have_the_cpus_for_the_workers(small_cfg, monkeypatch):
    from dppo.launch import preflight, ray_cluster
    from dppo.trainer import placement
    from dppo.config import ConfigError

    monkeypatch.setattr(ray_cluster, "cluster_cpus", lambda: 3.0)
    monkeypatch.setattr(
        placement, "pool_nodes", lambda trainer, rollout: None
    )  # the pools fit (tests/integration/test_rollout_placement.py)
    cfg = small_cfg(**{"ray.enabled": True, "ray.address": "auto", "rollout.num_workers": 2, "rollout.num_threads": 2})
    with pytest.raises(
        ConfigError,
        match="rollout.num_workers=2 with rollout.num_threads=2: 4 worker threads, but the Ray cluster has 3 CPUs",
    ):
        preflight.check_cluster_fits(cfg.trainer, cfg.rollout, cfg.ray)
    fits = small_cfg(**{"ray.enabled": True, "ray.address": "auto", "rollout.num_workers": 3})
    preflight.check_cluster_fits(fits.trainer, fits.rollout, fits.ray)


@pytest.mark.parametrize("sizes", [(12, 64, 2, 128), (12, 32, 1, 64), (1000, 96, 3, 200)])
def test_the_parameter_count_of_the_memory_check_is_the_models(sizes):
    """The pre-flight counts the tiny model's parameters without building it: the same number as the model."""
    import torch

    from dppo.models import tiny_model_config
    from dppo.launch.plan import tiny_model_parameters

    vocab, hidden, layers, intermediate = sizes
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(tiny_model_config(vocab, hidden, layers, 4, intermediate))
    assert tiny_model_parameters(vocab, hidden, layers, intermediate) == sum(p.numel() for p in model.parameters())
