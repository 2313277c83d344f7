"""rollout.verify_sync on the hf engine: a load that leaves one tensor as it was or a tensor of the engine changed
after the load (in-process), or weights garbled on their way to a local worker, are caught, named with the version;
a local worker is restarted (the run ends once its restarts are used up, and in-process, where nothing can be
restarted); with the check off it passes unnoticed. Its time reaches the run's metrics (timing_s/weight_sync_verify)."""

from __future__ import annotations

import pytest
import torch

from dppo.trainer.state import RolloutStart
from dppo.config import load_config
from dppo.data import make_prompt_source
from dppo.models import build_model, policy_config
from dppo.trainer.rollout import InProcessRollout, LocalRollout, RolloutFailedError, local_source
from dppo.workers.rollout.engines import WeightSync
from dppo.workers.rollout.engines.hf import HFEngine
from dppo.workers.rollout.process import SharedState
from tests.tiny_run import small_overrides

DROPPED = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _setup(tmp_path, **extra):
    cfg = load_config(overrides=small_overrides(tmp_path, **extra))
    source = make_prompt_source(cfg)
    model = build_model(cfg.model, source.vocab_size, cfg.trainer.seed)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert DROPPED in state
    return cfg, source, policy_config(cfg.model, source.vocab_size), state


def _drop_a_tensor(monkeypatch) -> None:
    """The planted bug: the hf engine's load leaves DROPPED as it was (an endpoint that said it loaded everything)."""

    def load_weights(self, state_dict):
        kept = {k: v for k, v in state_dict.items() if k != DROPPED}
        self.model.load_state_dict(kept, strict=False)
        return WeightSync(0.0, 0)

    monkeypatch.setattr(HFEngine, "load_weights", load_weights)


def test_in_process_a_dropped_tensor_ends_the_run_naming_it_and_the_version(tmp_path, monkeypatch):
    cfg, source, model_config, state = _setup(tmp_path)
    _drop_a_tensor(monkeypatch)
    rollout = InProcessRollout(cfg, source, model_config, RolloutStart())
    try:
        rollout.publish(state, 0)
        with pytest.raises(
            RolloutFailedError,
            match=rf"failed its weight sync check: after loading version 0, the rollout engine's {DROPPED} differs",
        ):
            rollout.fetch(cfg.groups_per_trigger, 0)
    finally:
        rollout.close()


def test_with_verify_sync_off_nothing_is_checked(tmp_path, monkeypatch):
    cfg, source, model_config, state = _setup(tmp_path, **{"rollout.verify_sync": False})
    _drop_a_tensor(monkeypatch)
    rollout = InProcessRollout(cfg, source, model_config, RolloutStart())
    try:
        rollout.publish(state, 0)
        groups, _ = rollout.fetch(cfg.groups_per_trigger, 0)  # generated with a wrong tensor, unnoticed
        assert len(groups) == cfg.groups_per_trigger
        assert rollout.buffer.weights is not None and rollout.buffer.fingerprint is None  # none taken
        held = rollout.worker.engine.model.state_dict()[DROPPED]
        assert not torch.equal(held, state[DROPPED])  # the planted bug did leave the tensor as it was
    finally:
        rollout.close()


def test_a_correct_load_passes_the_check(tmp_path):
    cfg, source, model_config, state = _setup(tmp_path)
    rollout = InProcessRollout(cfg, source, model_config, RolloutStart())
    try:
        rollout.publish(state, 0)
        rollout.fetch(cfg.groups_per_trigger, 0)
        assert rollout.worker.last_sync.verify_seconds is not None  # checked
        assert rollout.buffer.fingerprint.dtype == "float32"
    finally:
        rollout.close()


CORRUPTED = "model.layers.0.self_attn.o_proj.weight"


def _corrupt_after_load(monkeypatch) -> None:
    """The planted bug: something writes into the hf engine's model after a correct load (one element of CORRUPTED)."""
    load_weights = HFEngine.load_weights

    def corrupting(self, state_dict):
        sync = load_weights(self, state_dict)
        with torch.no_grad():
            self.model.get_parameter(CORRUPTED).view(-1)[3] += 1.0
        return sync

    monkeypatch.setattr(HFEngine, "load_weights", corrupting)


def test_in_process_a_tensor_of_the_engine_changed_after_a_correct_load_ends_the_run_naming_it(tmp_path, monkeypatch):
    """The check reads the engine's own model after the load (never what it was handed), as the vllm engine's does:
    one element changed there is a mismatch; no worker process to restart in-process, so the run ends."""
    cfg, source, model_config, state = _setup(tmp_path)
    _corrupt_after_load(monkeypatch)
    rollout = InProcessRollout(cfg, source, model_config, RolloutStart())
    try:
        rollout.publish(state, 0)
        with pytest.raises(
            RolloutFailedError,
            match=rf"failed its weight sync check: after loading version 0, the rollout engine's {CORRUPTED} "
            rf"differs from the published tensor \(checksum -?0x[0-9a-f]+ in float32, published -?0x[0-9a-f]+\)",
        ):
            rollout.fetch(cfg.groups_per_trigger, 0)
        assert rollout.buffer.stats()["replay/size"] == 0.0  # nothing generated with the wrong weights
    finally:
        rollout.close()


def test_on_a_worker_a_changed_tensor_fails_the_load_as_the_vllm_engines_would_and_forgets_the_publish(
    tmp_path, monkeypatch
):
    """The worker's side (RolloutGenerator.check_load, on Ray and in local processes alike): WeightSyncMismatchError,
    which the sources answer with a restart, and no claim to hold the publish (the next load is a full one)."""
    from dppo.trainer.rollout.settings import worker_settings
    from dppo.workers.rollout.worker import RolloutGenerator
    from dppo.workers.sync_check import WeightSyncMismatchError
    from dppo.workers.weight_fingerprint import fingerprint

    cfg, source, model_config, state = _setup(tmp_path)
    _corrupt_after_load(monkeypatch)
    generator = RolloutGenerator(worker_settings(cfg, source, model_config), source, model_config, 0)
    generator.loaded_publish = "an earlier publish"
    with pytest.raises(WeightSyncMismatchError) as err:
        generator.load_weights(state, 3, fingerprint(state, torch.float32))
    assert (err.value.tensor, err.value.version) == (CORRUPTED, 3) and generator.loaded_publish is None


@pytest.mark.parametrize(
    "mode, verify_sync",
    [("sync", True), ("separate_async", True), ("sync", False)],
    ids=["in_process", "local_workers", "in_process_unchecked"],
)
def test_a_tiny_run_on_the_hf_engine_reports_the_check_of_each_load_in_its_metrics(tmp_path, mode, verify_sync):
    """rollout.verify_sync (the default) with the default engine: timing_s/weight_sync_verify in every record of
    metrics.jsonl, whether the check ran in this process or in a worker's (the hf engine reports no other sync
    metric); with the check off, no such key."""
    from dppo.trainer.ppo import PPOTrainer
    from dppo.trainer.report import read_metrics

    overrides = {"trainer.mode": mode, "trainer.total_steps": 2, "rollout.verify_sync": verify_sync}
    cfg = load_config(overrides=small_overrides(tmp_path, **overrides))
    assert cfg.rollout.name == "hf"
    PPOTrainer(cfg).fit()
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert "rollout/weight_sync_bytes" not in r and "timing_s/rollout_weight_sync" not in r
        if verify_sync:
            assert r["timing_s/weight_sync_verify"] > 0, r
        else:
            assert "timing_s/weight_sync_verify" not in r, r


def _local(tmp_path, monkeypatch, max_restarts: int):
    """A local rollout whose first publish reaches the workers with DROPPED garbled in its shared memory (the planted
    transport bug), while the trainer's fingerprint is of what it meant to publish. Planted in this process (the
    workers may be forked or spawned alike)."""
    cfg, source, model_config, state = _setup(
        tmp_path, **{"trainer.mode": "separate_async", "ray.enabled": False, "rollout.max_restarts": max_restarts}
    )

    class Garbled(SharedState):
        def __init__(self, state_dict):
            super().__init__(state_dict)
            self.state_dict()[DROPPED].add_(1.0)  # the views are the workers' memory

    local = LocalRollout(cfg, source, model_config, RolloutStart(), fork=True)
    monkeypatch.setattr(local_source, "SharedState", Garbled)
    local.publish(state, 0)
    monkeypatch.undo()
    return cfg, source, model_config, state, local


def _exited(process, timeout_s: float = 120.0) -> None:
    """Wait for a worker's process to end (it exits once it reported its error)."""
    process.join(timeout_s)
    assert process.exitcode == 1, process.exitcode


def test_a_local_worker_whose_load_fails_the_check_is_restarted_and_its_groups_are_the_right_ones(
    tmp_path, monkeypatch
):
    cfg, source, model_config, state, local = _local(tmp_path, monkeypatch, max_restarts=1)
    reference = InProcessRollout(cfg, source, model_config, RolloutStart())
    try:
        _exited(local.workers[0].process)  # it loaded the garbled tensor and failed the check
        local._published.state_dict()[DROPPED].copy_(state[DROPPED])  # repaired: the next incarnation reads it right
        reference.publish(state, 0)
        got, _ = local.fetch(cfg.groups_per_trigger, 0)
        want, _ = reference.fetch(cfg.groups_per_trigger, 0)
        assert local.worker_restarts == 1 and local.workers[0].restarts == 1
        assert [g.index for g in got] == [g.index for g in want]
        for a, b in zip(got, want):  # generated by the restarted worker from the right weights
            assert torch.equal(a.responses, b.responses) and torch.equal(a.behav_logp, b.behav_logp)
    finally:
        local.close()
        reference.close()


def test_a_local_worker_that_fails_the_check_with_no_restarts_left_ends_the_run_naming_the_tensor(
    tmp_path, monkeypatch
):
    cfg, _, _, _, local = _local(tmp_path, monkeypatch, max_restarts=0)
    try:
        with pytest.raises(
            RolloutFailedError,
            match=rf"rollout worker 0 failed its weight sync check \(after loading version 0, the rollout engine's "
            rf"{DROPPED} differs .*\) and its restarts are used up \(0 of rollout.max_restarts=0\)",
        ):
            local.fetch(cfg.groups_per_trigger, 0)
    finally:
        local.close()
