"""rollout.nnodes x rollout.n_gpus_per_node: the rollout's own GPU pool, one worker per GPU; impossible combinations
fail when the config is read, in one line naming the values (`dppo train` exit code 2)."""

import pytest

from dppo.cli import main
from dppo.config import ConfigError, load_config

# A joined cluster (never contacted while the config is read): the local-CPU check of the workers' threads is
# then the preflight's, so these configs are judged by the pool rules alone.
JOINED = ["ray.address=auto", "trainer.mode=separate_async"]


def test_the_default_is_no_pool():
    cfg = load_config()
    assert (cfg.rollout.nnodes, cfg.rollout.n_gpus_per_node) == (1, 0)


def test_a_pool_of_one_worker_per_gpu_is_accepted():
    cfg = load_config([*JOINED, "rollout.nnodes=2", "rollout.n_gpus_per_node=4", "rollout.num_workers=8"])
    assert (cfg.rollout.nnodes, cfg.rollout.n_gpus_per_node, cfg.rollout.num_workers) == (2, 4, 8)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["rollout.n_gpus_per_node=4"],
            "rollout.num_workers=1, but the rollout's pool rollout.nnodes=1 x rollout.n_gpus_per_node=4 holds 4 GPUs, "
            "one per rollout worker; set rollout.num_workers=4",
        ),
        (
            ["rollout.nnodes=2", "rollout.n_gpus_per_node=2", "rollout.num_workers=2"],
            "rollout.num_workers=2, but the rollout's pool rollout.nnodes=2 x rollout.n_gpus_per_node=2 holds 4 GPUs",
        ),
        (["rollout.nnodes=2"], "rollout.nnodes=2: expected 1 while rollout.n_gpus_per_node=0"),
        (["rollout.nnodes=0"], "rollout.nnodes=0: expected a value > 0"),
        (["rollout.n_gpus_per_node=-1"], "rollout.n_gpus_per_node=-1: expected a value >= 0"),
    ],
)
def test_impossible_pools_are_refused(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config([*JOINED, *overrides])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_a_pool_without_ray_is_refused():
    with pytest.raises(
        ConfigError,
        match="rollout.n_gpus_per_node=1 gives the rollout workers GPUs of their own as "
        "Ray actors; ray.enabled=false generates on this machine's CPU",
    ):
        load_config(["ray.enabled=false", "trainer.mode=sync", "rollout.n_gpus_per_node=1"])


def test_dppo_train_refuses_it_in_one_line_with_exit_code_2(small_args, capsys):
    code = main(["train", *small_args(**{"rollout.n_gpus_per_node": 2})])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert lines[-1].startswith("dppo: error: rollout.num_workers=1, but the rollout's pool"), lines
    assert not any("Traceback" in line for line in lines)
