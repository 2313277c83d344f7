"""rollout.partial_rollout with local worker processes: a worker that finds a newer version on the trainer's shared
counter mid-ticket asks for it over its pipe and the ticket's unfinished responses go on under it. Deterministic: the
worker's first look waits until the test has published the newer version (the wait is patched into the worker, forked
from this process, an event the test controls)."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch

import dppo.workers.rollout.process as process
from dppo.trainer.state import RolloutStart
from dppo.config import load_config
from dppo.data import make_prompt_source
from dppo.models import build_model, policy_config
from dppo.trainer.rollout import LocalRollout
from dppo.trainer.rollout.settings import worker_settings
from dppo.workers.rollout.worker import RolloutGenerator
from tests.tiny_run import small_overrides

EXTRA = {
    "trainer.mode": "separate_async",
    "ray.enabled": False,
    "rollout.partial_rollout": True,
    "rollout.partial_chunk": 1,
    "task.length": 3,  # responses of 4 tokens: a look after each of the first three
}


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _first_look_waits_for_version_1(monkeypatch) -> None:
    real = process.PipeClient.newer
    looked = []

    def newer(self, version):
        if not looked:
            looked.append(1)
            deadline = time.monotonic() + 60
            while self.published.value < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
        return real(self, version)

    monkeypatch.setattr(process.PipeClient, "newer", newer)
    # forked always (LocalRollout spawns where other threads run, as after other tests here): the patch must reach it
    monkeypatch.setattr(LocalRollout, "_context", staticmethod(lambda fork: multiprocessing.get_context("fork")))


def test_a_local_worker_loads_a_version_published_mid_ticket_and_its_groups_carry_each_tokens_version(
    tmp_path, monkeypatch
):
    cfg = load_config(overrides=small_overrides(tmp_path, **EXTRA))
    source = make_prompt_source(cfg)
    model_config = policy_config(cfg.model, source.vocab_size)
    v0 = {k: v.detach().clone() for k, v in build_model(cfg.model, source.vocab_size, 1).state_dict().items()}
    v1 = {k: v.detach().clone() for k, v in build_model(cfg.model, source.vocab_size, 2).state_dict().items()}
    _first_look_waits_for_version_1(monkeypatch)
    local = LocalRollout(cfg, source, model_config, RolloutStart(), fork=True)
    try:
        local.publish(v0, 0)  # the worker's first ticket: version 0; its first look waits for version 1
        deadline = time.monotonic() + 60
        while local.buffer.core.in_flight == 0 and time.monotonic() < deadline:  # the ticket granted at version 0
            time.sleep(0.01)
        local.publish(v1, 1)
        groups, dropped = local.fetch(cfg.rollout.groups_per_batch, 1)
    finally:
        local.close()
    assert dropped == 0 and [g.index for g in groups] == [0, 1]
    assert all(g.version == 0 for g in groups)  # the ticket's start version: staleness counts the oldest token
    # the same ticket generated here, its first look handing version 1
    reference = RolloutGenerator(worker_settings(cfg, source, model_config), source, model_config, 0)
    reference.load_weights(v0, 0)
    reference.seed_ticket(0)
    looks = []

    def refresh():
        looks.append(1)
        return (lambda: (reference.load_weights(v1, 1), 1)[1]) if len(looks) == 1 else None

    expected = reference.generate(cfg.rollout.groups_per_batch, refresh)
    for got, want in zip(groups, expected):
        assert torch.equal(got.responses, want.responses) and torch.equal(got.behav_logp, want.behav_logp)
        assert torch.equal(got.token_versions, want.token_versions)
        versions, mask = got.token_versions, got.response_mask
        assert (versions[:, 0] == 0).all() and (versions[mask[:, 1:].nonzero(as_tuple=True)[0], 1:] == 1).all()
