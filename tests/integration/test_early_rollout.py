"""A fresh run on Ray starts its rollout before the actor's ranks (the start-ups overlap), closes it if fit() never
runs, and falls back to making it in fit() when the ranks' model config is not the one the config predicted."""

from __future__ import annotations

import time

import pytest
import ray

from dppo.config import load_config
from dppo.trainer import base
from dppo.trainer.ppo import PPOTrainer
from dppo.trainer.rollout import RayRollout

from tiny_run import tiny_run  # tests/tiny_run.py (tests/conftest.py puts tests/ on sys.path)

pytestmark = pytest.mark.integration


def cfg(tmp_path, *extra):
    return load_config(tiny_run(tmp_path / "out", 2, "trainer.checkpoint_every=0", "ray.num_cpus=2", *extra))


def _alive(actor) -> bool:
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=60)
        return True
    except ray.exceptions.RayActorError:
        return False


def _killed(actor, timeout_s: float = 60.0) -> bool:
    """Whether actor dies within timeout_s (ray.kill is asynchronous: a call right after it may still be served)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(actor):
            return True
        time.sleep(0.2)
    return False


def test_the_rollout_starts_before_the_ranks_and_closes_without_fit(ray_cluster, tmp_path, monkeypatch):
    order = []
    for name, fn in (("rollout", base.make_rollout), ("ranks", base.make_worker_group)):
        monkeypatch.setattr(
            base,
            f"make_{'rollout' if name == 'rollout' else 'worker_group'}",
            lambda *a, _fn=fn, _name=name, **k: (order.append(_name), _fn(*a, **k))[1],
        )
    trainer = PPOTrainer(cfg(tmp_path))
    assert order == ["rollout", "ranks"]
    rollout = trainer.rollout
    assert isinstance(rollout, RayRollout)
    actors = [w.actor for w in rollout.workers] + [rollout.buffer]
    assert all(_alive(a) for a in actors)  # built with the predicted config: the worker's constructor ran
    trainer.close()  # fit() never ran: close() must not leave the workers and the buffer behind
    assert trainer.rollout is None
    assert all(_killed(a) for a in actors)


def test_a_config_the_ranks_do_not_share_makes_fit_build_the_rollout_anew(ray_cluster, tmp_path, monkeypatch):
    wrong = base.policy_config

    def predicted(model_cfg, vocab_size):
        config = wrong(model_cfg, vocab_size)
        config.rms_norm_eps = 1e-3  # not what the ranks build
        return config

    monkeypatch.setattr(base, "policy_config", predicted)
    trainer = PPOTrainer(cfg(tmp_path))
    assert trainer.rollout is None  # the early one was closed once the ranks' config differed
    result = trainer.fit()
    assert [r["step"] for r in result.records] == [1, 2]


def test_a_fresh_run_trains_with_its_early_rollout(ray_cluster, tmp_path):
    trainer = PPOTrainer(cfg(tmp_path))
    early = trainer.rollout
    result = trainer.fit()
    assert trainer.rollout is early and early is not None  # fit() ran the rollout the constructor started
    assert [r["step"] for r in result.records] == [1, 2]
    assert all(_killed(a) for a in [w.actor for w in early.workers] + [early.buffer])  # fit() closed it
