"""Separate-async rollout without Ray (dppo.trainer.rollout.local_source): worker processes beside the trainer, the
replay buffer in the trainer's process. Real processes: forked and spawned workers, a SIGKILLed worker, a worker that
raises, a SIGKILLed trainer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from dppo.launch.machine import resolve_ray
import torch

from dppo.config import load_config
from dppo.config.checks import ConfigError
from dppo.data import make_prompt_source
from dppo.models import build_model, policy_config
from dppo.trainer.rollout import InProcessRollout, LocalRollout, RolloutFailedError
from dppo.trainer.state import RolloutStart
from dppo.workers.rollout.process import SharedState
from tests.processes import alive
from tests.tiny_run import small_overrides

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture(autouse=True)
def _one_thread():
    """The in-process reference generates with the workers' thread count (rollout.num_threads=1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _cfg(tmp_path, **extra):
    values = {"trainer.mode": "separate_async", "ray.enabled": False, "rollout.max_restarts": 1, **extra}
    return load_config(overrides=small_overrides(tmp_path, **values))


def _setup(tmp_path, **extra):
    cfg = _cfg(tmp_path, **extra)
    source = make_prompt_source(cfg)
    model = build_model(cfg.model, source.vocab_size, cfg.trainer.seed)
    return cfg, source, policy_config(cfg.model, source.vocab_size), model


def _started(cfg, source, model_config, model):
    """A LocalRollout (its workers forked where they may be) and the in-process reference, both given the model's
    weights as version 0."""
    local = LocalRollout(cfg, source, model_config, RolloutStart(), fork=True)
    reference = InProcessRollout(cfg, source, model_config, RolloutStart())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    local.publish(state, 0)
    reference.publish(state, 0)
    return local, reference


def _same_groups(a, b) -> None:
    assert [g.index for g in a] == [g.index for g in b]
    for x, y in zip(a, b):
        assert x.version == y.version
        assert torch.equal(x.prompt, y.prompt) and torch.equal(x.responses, y.responses)
        assert torch.equal(x.behav_logp, y.behav_logp) and torch.equal(x.scores, y.scores)


def test_shared_state_is_one_shared_file_a_tied_weight_once_and_a_copy():
    a, b = torch.randn(3, 4), torch.randn(5).bfloat16()
    state = {"a": a, "tied": a, "b": b, "c": torch.randn(2), "empty": torch.empty(0)}
    shared = SharedState(state)
    views = shared.state_dict()
    assert list(views) == list(state)
    assert all(torch.equal(views[k], state[k]) and views[k].dtype == state[k].dtype for k in state)
    assert shared.layout.nbytes == 3 * 64  # a (48 B), b (10 B) and c (8 B), each from a 64-byte boundary; tied once
    assert views["a"].data_ptr() == views["tied"].data_ptr()
    a.add_(1)  # a copy: the trainer's live weights move on, the published ones do not
    assert not torch.equal(views["a"], a)
    # what a worker maps from the descriptor it is sent: the same bytes, through a descriptor of its own
    mapped = SharedState.attach(os.dup(shared.fd), shared.layout)
    assert all(torch.equal(mapped[k], views[k]) for k in state)
    assert os.readlink(f"/proc/self/fd/{shared.fd}").startswith("/memfd:dppo-rollout-weights")


def test_workers_are_forked_only_from_a_process_without_other_threads(monkeypatch):
    """fork copies only the calling thread: with any other thread running (one that might hold a lock the worker then
    needs) the workers are spawned; the stop-signal watcher, which blocks in a read holding nothing, is allowed."""
    monkeypatch.setattr(threading, "enumerate", lambda: [threading.main_thread()])
    assert LocalRollout._context(fork=True).get_start_method() == "fork"  # noqa: SLF001
    assert LocalRollout._context(fork=False).get_start_method() == "spawn"  # noqa: SLF001
    watcher = threading.Thread(name="dppo-stop-watcher")
    monkeypatch.setattr(threading, "enumerate", lambda: [threading.main_thread(), watcher])
    assert LocalRollout._context(fork=True).get_start_method() == "fork"  # noqa: SLF001
    other = threading.Thread(name="somebody-else")
    monkeypatch.setattr(threading, "enumerate", lambda: [threading.main_thread(), watcher, other])
    assert LocalRollout._context(fork=True).get_start_method() == "spawn"  # noqa: SLF001


def test_local_workers_generate_what_the_in_process_rollout_does(tmp_path):
    """Two worker processes (forked where this process has no other thread), tickets seeded by their grant index: the groups of version 0 are bitwise those the
    in-process generator makes from the same weights; after the next publish the groups go on in grant order, no
    staler than the threshold allows."""
    cfg, source, model_config, model = _setup(tmp_path, **{"rollout.num_workers": 2})
    local, reference = _started(cfg, source, model_config, model)
    try:
        got, dropped = local.fetch(cfg.groups_per_trigger, 0)
        want, _ = reference.fetch(cfg.groups_per_trigger, 0)
        assert dropped == 0
        _same_groups(got, want)
        with torch.no_grad():
            next(model.parameters()).add_(0.5)
        local.publish({k: v.detach().clone() for k, v in model.state_dict().items()}, 1)
        later, dropped = local.fetch(cfg.groups_per_trigger, 1)
        assert [g.index for g in later] == [g.index + len(got) for g in got] and dropped == 0
        assert all(g.version in (0, 1) for g in later)  # generated ahead with version 0, or with 1
        assert local.stats()["rollout/worker_restarts"] == 0.0
        pids = [w.process.pid for w in local.workers]
        names = lambda: [open(f"/proc/{pid}/comm").read().strip() for pid in pids]  # noqa: E731
        deadline = time.monotonic() + 120  # a spawned worker names itself once its imports are done
        while names() != ["dppo-rollout-0", "dppo-rollout-1"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert names() == ["dppo-rollout-0", "dppo-rollout-1"]
    finally:
        local.close()
        reference.close()
    assert not any(alive(pid) for pid in pids)


def test_a_killed_worker_is_restarted_and_its_groups_generated_anew(tmp_path):
    cfg, source, model_config, model = _setup(tmp_path)
    local, reference = _started(cfg, source, model_config, model)
    try:
        first = local.workers[0].process
        os.kill(first.pid, signal.SIGKILL)
        first.join()
        got, _ = local.fetch(cfg.groups_per_trigger, 0)
        want, _ = reference.fetch(cfg.groups_per_trigger, 0)
        _same_groups(got, want)  # none lost, none twice, the same samples
        assert local.worker_restarts == 1 and local.workers[0].restarts == 1
        assert local.workers[0].process._popen.method == "spawn"  # noqa: SLF001  (a fork now would copy threads)
        assert local.stats()["rollout/worker_restarts"] == 1.0
        os.kill(local.workers[0].process.pid, signal.SIGKILL)  # max_restarts=1: used up
        local.workers[0].process.join()
        with pytest.raises(
            RolloutFailedError,
            match=r"rollout worker 0 was killed by SIGKILL and its restarts are "
            r"used up \(1 of rollout.max_restarts=1\)",
        ):
            local.fetch_ready(cfg.groups_per_trigger, 0)  # looks at the workers first (fetch may find groups ready)
    finally:
        local.close()
        reference.close()


def test_a_worker_that_raises_fails_the_rollout_with_its_error(tmp_path):
    cfg, source, model_config, model = _setup(tmp_path)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state.pop(next(iter(state)))  # a state dict the worker's model cannot load
    local = LocalRollout(cfg, source, model_config, RolloutStart(), fork=True)
    try:
        local.publish(state, 0)
        with pytest.raises(RolloutFailedError, match=r"rollout worker 0 raised RuntimeError: .*Missing key"):
            local.fetch(cfg.groups_per_trigger, 0)
        assert local.worker_restarts == 0  # an error is not a death: no restart
    finally:
        local.close()


def test_a_failure_answering_a_worker_ends_the_rollout_instead_of_leaving_it_waiting(tmp_path):
    """The trainer's thread that answers a worker's pipe raises (here the buffer's put): the worker, which would wait
    for that answer for ever, is stopped and the next fetch fails naming what was raised; not restarted (the same
    answer would fail again)."""
    cfg, source, model_config, model = _setup(tmp_path)
    local = LocalRollout(cfg, source, model_config, RolloutStart(), fork=True)

    def put(*args, **kwargs):
        raise RuntimeError("the buffer cannot take this group")

    local.buffer.put = put  # what answer_calls calls for a worker's "put"
    try:
        local.publish({k: v.detach().clone() for k, v in model.state_dict().items()}, 0)
        with pytest.raises(
            RolloutFailedError,
            match=r"the trainer failed to answer rollout worker 0 \(RuntimeError: the buffer cannot take this "
            r"group\); the worker was stopped",
        ):
            local.fetch(cfg.groups_per_trigger, 0)
        assert local.worker_restarts == 0 and not local.workers[0].process.is_alive()
    finally:
        local.close()


def test_the_workers_die_with_a_killed_trainer(tmp_path):
    """SIGKILL the trainer's process: its workers (forked, waiting for weights) are gone within seconds."""
    overrides = small_overrides(
        tmp_path, **{"trainer.mode": "separate_async", "ray.enabled": False, "rollout.num_workers": 2}
    )
    script = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {REPO!r})
        from dppo.config import load_config
        from dppo.data import make_prompt_source
        from dppo.models import policy_config
        from dppo.trainer.rollout import LocalRollout
        from dppo.trainer.state import RolloutStart
        cfg = load_config(overrides={overrides!r})
        source = make_prompt_source(cfg)
        model_config = policy_config(cfg.model, source.vocab_size)
        rollout = LocalRollout(cfg, source, model_config, RolloutStart(), fork=True)
        print(" ".join(str(w.process.pid) for w in rollout.workers), flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)


def test_auto_runs_one_cpu_machine_without_ray_and_the_rest_on_ray(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    auto = {"ray.enabled": None, "trainer.device": "cpu"}
    assert not _cfg(tmp_path, **auto).use_ray
    assert not _cfg(tmp_path, **auto, **{"trainer.mode": "sync"}).use_ray
    assert not _cfg(tmp_path, **auto, **{"rollout.name": "vllm"}).use_ray  # vLLM engines in local processes too
    for needs_ray in ({"ray.address": "10.0.0.1:6379"}, {"trainer.n_gpus_per_node": 2}, {"rollout.n_gpus_per_node": 1}):
        assert _cfg(tmp_path, **auto, **needs_ray).use_ray, needs_ray
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # the machine's part of the rule, decided before the run
    assert resolve_ray(_cfg(tmp_path, **auto)).use_ray
    assert not resolve_ray(_cfg(tmp_path, **{**auto, "ray.enabled": False})).use_ray  # explicit false wins


def test_local_processes_refuse_what_needs_ray(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout.n_gpus_per_node=1 gives the rollout workers GPUs"):
        _cfg(tmp_path, **{"rollout.n_gpus_per_node": 1})
