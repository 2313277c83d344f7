"""The rollout-source interface (dppo.trainer.rollout.source) and the worker supervision RayRollout and LocalRollout
share (dppo.trainer.rollout.supervised), the latter on scripted workers: no process, no Ray, every end a worker can
come to chosen by the test."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
import torch

from dppo.trainer.state import RolloutStart
from dppo.config import ReplayConfig, RolloutConfig
from dppo.data import make_prompt_source
from dppo.models import policy_config
from dppo.trainer.rollout import (
    InProcessRollout,
    LocalRollout,
    RolloutFailedError,
    RolloutSource,
    make_rollout,
)
from dppo.trainer.rollout.common import RolloutSettings
from dppo.trainer.rollout.supervised import SupervisedRollout, WorkerEnd, WorkerRecord
from dppo.workers.rollout.buffer_server import BufferServer

KILLED = WorkerEnd("died", "was killed by SIGKILL")


def test_a_source_that_leaves_a_method_out_cannot_be_made():
    assert RolloutSource.__abstractmethods__ == {
        "start",
        "publish",
        "published_weights",
        "fetch",
        "fetch_ready",
        "discard",
        "stats",
        "describe",
        "worker_restarts",
        "close",
    }
    all_but_describe = {name: lambda *args: None for name in RolloutSource.__abstractmethods__ if name != "describe"}
    with pytest.raises(TypeError, match=r"abstract method describe$"):
        type("NoDescribe", (RolloutSource,), all_but_describe)()
    type("Whole", (RolloutSource,), {**all_but_describe, "describe": lambda self: "rollout: here"})()


@pytest.mark.parametrize("mode, kind", [("sync", InProcessRollout), ("separate_async", LocalRollout)])
def test_make_rollout_gives_the_source_the_config_asks_for_each_describing_itself_in_one_line(small_cfg, mode, kind):
    cfg = small_cfg(**{"trainer.mode": mode, "ray.enabled": False})
    source = make_prompt_source(cfg)
    rollout = make_rollout(cfg, source, policy_config(cfg.model, source.vocab_size), RolloutStart(worker_restarts=2))
    try:
        assert type(rollout) is kind and isinstance(rollout, RolloutSource)
        line = rollout.describe()
        assert line.startswith("rollout: ") and "\n" not in line
        # the count a resumed run's checkpoint carries goes on where the workers can die apart from the trainer
        assert rollout.worker_restarts == (2 if kind is LocalRollout else 0)
        assert rollout.stats()["rollout/worker_restarts"] == float(rollout.worker_restarts)
    finally:
        rollout.close()


# ---- the supervision base, on scripted workers ---------------------------------------------------------------


@dataclass
class ScriptedWorker(WorkerRecord):
    end: WorkerEnd | None = None  # what _ended reports: None while it runs


class ScriptedRollout(SupervisedRollout[ScriptedWorker]):
    """Two workers whose ends the test sets; the buffer records what it was told; a fetch finds its groups after
    `waits` waits that give up (each followed by a look at the workers)."""

    def __init__(self, max_restarts: int = 1, start: RolloutStart | None = None, waits: int = 1) -> None:
        rollout = RolloutConfig(num_workers=2, max_restarts=max_restarts)
        super().__init__(RolloutSettings(rollout, ReplayConfig(), "separate_async", 4), start or RolloutStart())
        self.calls: list[tuple] = []  # every call that reached the buffer, and every retired holder
        self.buffer_dead, self.waits = False, waits
        self.workers = [self._spawn(i, self.new_holder(), 0) for i in range(2)]

    def _spawn(self, index: int, holder: int, restarts: int) -> ScriptedWorker:
        return ScriptedWorker(index, holder, restarts)

    def _retire(self, worker: ScriptedWorker) -> None:
        self.calls.append(("retire", worker.holder))

    def _ended(self, worker: ScriptedWorker) -> WorkerEnd | None:
        return worker.end

    def _check_buffer(self) -> None:
        if self.buffer_dead:
            raise RolloutFailedError("the replay buffer died")

    def _buffer_call(self, name: str, *args):
        if name == "take_ready":
            return [], 0
        self.calls.append((name, *args))
        return {"release": 3, "stats": {"replay/size": 0.0}}.get(name)

    def _taking(self, num_groups: int, trainer_version: int):
        left = [self.waits]

        def wait():
            left[0] -= 1
            return ([], 0) if left[0] < 0 else None

        return wait

    def start(self) -> None:
        pass

    def publish(self, weights, version: int) -> None:
        pass

    def published_weights(self):
        return {}

    def describe(self) -> str:
        return "rollout: scripted"

    def close(self) -> None:
        pass


def test_a_worker_that_dies_while_the_trainer_waits_is_restarted_and_its_tickets_granted_again(caplog):
    rollout = ScriptedRollout(max_restarts=2, start=RolloutStart(worker_restarts=5))
    rollout.workers[1].end = KILLED
    with caplog.at_level(logging.WARNING, logger="dppo"):
        assert rollout.fetch(2, 0) == ([], 0)  # the wait that gave up looked at the workers: it found the death
    new = rollout.workers[1]
    assert (new.index, new.holder, new.restarts, new.end) == (1, 2, 1, None)  # a new incarnation, a new holder id
    assert rollout.workers[0].holder == 0 and rollout.workers[0].restarts == 0  # the other one untouched
    assert rollout.calls == [("retire", 1), ("release", 1)]  # the dead holder's tickets granted again, then the take
    assert rollout.worker_restarts == 6 and rollout.stats()["rollout/worker_restarts"] == 6.0
    assert caplog.messages == [
        "rollout worker 1 was killed by SIGKILL; restarted it (1 of rollout.max_restarts=2); "
        "its 3 outstanding groups are generated anew"
    ]


def test_a_worker_whose_restarts_are_used_up_ends_the_rollout_in_one_line():
    rollout = ScriptedRollout(max_restarts=1)
    rollout.workers[0].end = KILLED
    rollout.fetch_ready(2, 0)
    rollout.workers[0].end = KILLED
    with pytest.raises(RolloutFailedError) as err:
        rollout.fetch_ready(2, 0)  # looks at the workers before it takes
    assert str(err.value) == (
        "rollout worker 0 was killed by SIGKILL and its restarts are used up (1 of rollout.max_restarts=1)"
    )
    assert rollout.worker_restarts == 1 and rollout.workers[0].restarts == 1


def test_no_restarts_allowed_means_the_first_death_ends_the_rollout():
    rollout = ScriptedRollout(max_restarts=0)
    rollout.workers[1].end = WorkerEnd("died", "died with its node")
    with pytest.raises(
        RolloutFailedError,
        match=r"^rollout worker 1 died with its node and its restarts are used up "
        r"\(0 of rollout.max_restarts=0\)$",
    ):
        rollout.fetch(2, 0)
    assert rollout.worker_restarts == 0 and ("release", 1) not in rollout.calls


@pytest.mark.parametrize("end, message", [
    (WorkerEnd("raised", "RuntimeError: Missing key(s) in state_dict"),
     "rollout worker 1 raised RuntimeError: Missing key(s) in state_dict"),
    (WorkerEnd("stopped"), "rollout worker 1 stopped before the trainer finished"),
])  # fmt: skip
def test_a_worker_that_raised_or_stopped_ends_the_rollout_without_a_restart(end, message):
    rollout = ScriptedRollout(max_restarts=3)
    rollout.workers[1].end = end
    with pytest.raises(RolloutFailedError) as err:
        rollout.fetch(2, 0)
    assert str(err.value) == message
    assert rollout.worker_restarts == 0 and rollout.workers[1].holder == 1 and rollout.calls == []


@pytest.mark.parametrize("end", [KILLED, WorkerEnd("raised", "RayActorError: the actor died"), WorkerEnd("stopped")])
def test_a_dead_buffer_is_named_before_the_worker_it_took_down(end):
    """A worker whose call to a dead buffer failed looks dead, or raised: the error names the buffer."""
    rollout = ScriptedRollout(max_restarts=3)
    rollout.buffer_dead = True
    rollout.workers[0].end = end
    with pytest.raises(RolloutFailedError, match=r"^the replay buffer died$"):
        rollout.fetch(2, 0)
    assert rollout.worker_restarts == 0 and rollout.calls == []


MISMATCH = WorkerEnd("mismatch", "after loading version 2, the rollout engine's m.w differs from the published tensor")


def test_a_worker_that_failed_its_weight_sync_check_is_restarted_until_its_restarts_are_used_up(caplog):
    """rollout.verify_sync: an engine that does not hold what it loaded is a worker fault like a death (its groups would
    be tagged with a policy it does not have): restarted, its tickets granted again; once too often, the run ends
    with the tensor and the version named."""
    rollout = ScriptedRollout(max_restarts=1)
    rollout.workers[0].end = MISMATCH
    with caplog.at_level(logging.WARNING, logger="dppo"):
        rollout.fetch(2, 0)
    assert rollout.worker_restarts == 1 and rollout.workers[0].restarts == 1
    assert rollout.calls[:2] == [("retire", 0), ("release", 0)]
    assert caplog.messages == [
        "rollout worker 0 failed its weight sync check (after loading version 2, the rollout engine's m.w differs "
        "from the published tensor); restarted it (1 of rollout.max_restarts=1); its 3 outstanding groups are "
        "generated anew"
    ]
    rollout.workers[0].end = MISMATCH
    with pytest.raises(RolloutFailedError) as err:
        rollout.fetch(2, 0)
    assert str(err.value) == (
        "rollout worker 0 failed its weight sync check (after loading version 2, the rollout engine's m.w differs "
        "from the published tensor) and its restarts are used up (1 of rollout.max_restarts=1)"
    )


def test_on_ray_a_failed_check_is_a_mismatch_and_the_fingerprint_rank_0_published_goes_to_the_buffer(monkeypatch):
    """RayRollout's side, without a cluster: the WeightSyncMismatchError a worker's call raised (RayTaskError.cause)
    ends it as a mismatch, any other error as a raise; a publish [ref, fingerprint] from rank 0 hands the buffer the
    refs and the fingerprint apart."""
    from ray.exceptions import RayTaskError

    from dppo.trainer.rollout import ray_source
    from dppo.workers.sync_check import WeightFingerprint, WeightSyncMismatchError

    def raising(cause):
        def get(ref, timeout=None):
            raise RayTaskError("step", "traceback", cause)

        return get

    monkeypatch.setattr(ray_source.ray, "get", raising(WeightSyncMismatchError("m.w", 2, "differs")))
    assert ray_source.RayRollout._result(None) == (
        None,
        WorkerEnd("mismatch", "after loading version 2, the rollout engine's m.w differs"),
    )
    monkeypatch.setattr(ray_source.ray, "get", raising(ValueError("bad reward")))
    assert ray_source.RayRollout._result(None)[1] == WorkerEnd("raised", "ValueError: bad reward")

    class Recorder:
        calls: list = []

        def _buffer_call(self, *args):
            self.calls.append(args)

    prints = WeightFingerprint("bfloat16")
    source = Recorder()
    ray_source.RayRollout.publish(source, ["full ref", "delta", prints], 4)
    assert source.calls == [("publish", ["full ref", "delta"], 4, prints)] and source._published == [
        "full ref",
        "delta",
    ]


# ---- a publish that fails leaves the last one as the published weights -----------------------------------------


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"m.weight": torch.randn(4, 3, generator=g), "m.bias": torch.randn(3, generator=g)}


class _DyingCore:
    """A replay buffer core whose publish of version `dies_at` fails as a dead buffer's does (RolloutFailedError)."""

    def __init__(self, dies_at: int) -> None:
        self.dies_at, self.versions = dies_at, []

    def publish(self, weights, version: int, fingerprint=None) -> None:
        if version == self.dies_at:
            raise RolloutFailedError("the replay buffer died")
        self.versions.append(version)


def _ray_source(monkeypatch, dies_at: int):
    """RayRollout's publish over references that rank 0 put (a dict stands in for the object store), the buffer
    called through _buffer_call."""
    from dppo.trainer.rollout import ray_source

    store: dict[str, dict] = {}
    core = _DyingCore(dies_at)
    monkeypatch.setattr(ray_source.ray, "get", lambda ref, timeout=None: store[ref])
    source = object.__new__(ray_source.RayRollout)
    source._buffer_call = lambda name, *args: getattr(core, name)(*args)

    def publish(state, version):
        ref = f"ref of version {version}"
        store[ref] = {k: v.clone() for k, v in state.items()}  # rank 0's ray.put
        source.publish([ref], version)

    return source, publish, core


def _local_source(monkeypatch, dies_at: int):
    source = object.__new__(LocalRollout)
    core = _DyingCore(dies_at)
    source.buffer, source._print_dtype, source._published_version = BufferServer(core), None, None
    return source, source.publish, core


def _in_process_source(monkeypatch, dies_at: int):
    source = object.__new__(InProcessRollout)
    source.buffer, source._print_dtype = _DyingCore(dies_at), None
    return source, source.publish, source.buffer


@pytest.mark.parametrize("make", [_ray_source, _local_source, _in_process_source], ids=["ray", "local", "in_process"])
def test_a_publish_the_buffer_died_in_leaves_the_last_publish_as_the_published_weights(monkeypatch, make):
    """The end-of-cycle publish of version 2 fails (the buffer died in it): what a checkpoint written after the
    failure saves as the cycle's pi_old (published_weights) is still version 1's weights, bitwise, never version 2's
    under version 1's label."""
    source, publish, core = make(monkeypatch, dies_at=2)
    first, second = _state(1), _state(2)
    publish(first, 1)
    with pytest.raises(RolloutFailedError, match=r"^the replay buffer died$"):
        publish(second, 2)
    assert core.versions == [1]
    got = source.published_weights()
    assert got.keys() == first.keys()
    for name, tensor in first.items():
        assert torch.equal(got[name], tensor), f"{name} is not version 1's"
