"""Atomic checkpoints and in-process resume: state restored bitwise, metrics after the checkpoint dropped; the actor's
shards (torch.distributed.checkpoint) loaded without running code from the files."""

import hashlib
import io
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

import dppo.trainer.base as base
import dppo.trainer.filter_groups as filter_groups
import dppo.trainer.rollout.local_source as local_source
from dppo.checkpoint import store as ckpt
from dppo.checkpoint.layout import ACTOR_DIR, TRAINER_FILE
from dppo.trainer.ppo import PPOTrainer
from dppo.trainer.report import read_metrics


def test_atomic_write_leaves_old_file_on_failure(tmp_path):
    path = tmp_path / "x.bin"
    ckpt.atomic_write_bytes(path, lambda f: f.write(b"old"))

    def failing(f):
        f.write(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        ckpt.atomic_write_bytes(path, failing)
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["x.bin"]  # no temporary file left behind


def saved_state(directory) -> dict:
    """The trainer state of the newest trusted checkpoint in directory."""
    path, state = ckpt.CheckpointDir(directory).newest(lambda p, m: ckpt.load_torch(p / TRAINER_FILE))
    return state


def names(directory) -> list[str]:
    return [i.name for i in ckpt.CheckpointDir(directory).recorded()]


@pytest.mark.parametrize("anchor", ["current", "cycle_start"])
def test_resume_restores_state_and_continues_after_the_checkpoint(small_cfg, anchor):
    # The KL reference model is state too: it must be the run's initial weights after a resume.
    common = {"trainer.checkpoint_every": 2, "actor.kl_loss_coef": 0.1, "algorithm.prox_anchor": anchor}
    first = PPOTrainer(small_cfg(**{"trainer.total_steps": 3, **common}))
    rank = first.actor_group.local_rank  # ray.enabled=false: the one actor rank, in this process
    initial = weights(rank.model)
    first.fit()
    out = first.output_dir
    saved = saved_state(out / "checkpoints")
    assert names(out / "checkpoints") == ["step_00000002", "step_00000003"]
    assert saved["global_step"] == 3 and saved["version"] == 3 and saved["anchor"] is False
    saved_model, saved_optimizer = weights(rank.model), rank.optimizer.state_dict()  # what step 3's checkpoint holds

    # A run killed after step 3's checkpoint had logged steps 4 and 5 (the last line torn mid-write).
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 4, "critic/score/mean": -1.0}) + "\n" + '{"step": 5, "crit')

    resumed = PPOTrainer(small_cfg(**{"trainer.total_steps": 5, "trainer.resume": True, **common}))
    rank = resumed.actor_group.local_rank
    assert resumed.resumed_from.name == "step_00000003"
    assert (resumed.global_step, resumed.version) == (3, 3)
    for name, tensor in rank.model.state_dict().items():
        assert torch.equal(saved_model[name], tensor)
    opt_state = rank.optimizer.state_dict()["state"]
    assert opt_state.keys() == saved_optimizer["state"].keys()
    for index, tensors in saved_optimizer["state"].items():
        for key, value in tensors.items():
            assert torch.equal(opt_state[index][key], value)
    for name, tensor in rank.ref_model.state_dict().items():  # the run's initial weights, not step 3's
        assert torch.equal(initial[name], tensor)
    resumed.fit()
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [json.dumps(r) for r in records[:3]] == lines  # steps up to the checkpoint are kept as they were
    assert records[3]["critic/score/mean"] >= 0.0  # step 4 was re-run, not the stale line
    assert saved_state(out / "checkpoints")["global_step"] == 5


def test_resume_without_checkpoint_starts_fresh(small_cfg):
    trainer = PPOTrainer(small_cfg(**{"trainer.resume": True, "algorithm.prox_anchor": "current"}))
    assert trainer.resumed_from is None and trainer.global_step == 0


def test_a_fresh_run_discards_an_earlier_runs_checkpoints(small_cfg):
    cfg = small_cfg(**{"trainer.total_steps": 2, "trainer.checkpoint_every": 1, "algorithm.prox_anchor": "current"})
    PPOTrainer(cfg).fit()
    out = cfg.trainer.output_dir
    assert names(f"{out}/checkpoints") == ["step_00000001", "step_00000002"]
    fresh = PPOTrainer(
        small_cfg(**{"trainer.total_steps": 1, "trainer.checkpoint_every": 1, "algorithm.prox_anchor": "current"})
    )
    assert names(f"{out}/checkpoints") == [] and os.listdir(f"{out}/checkpoints") == []
    fresh.fit()
    assert names(f"{out}/checkpoints") == ["step_00000001"]
    assert [r["step"] for r in read_metrics(f"{out}/metrics.jsonl")] == [1]


def without_timing(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("timing_s/")} for r in records]


def weights(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


# Every prox_logp_method; auto with checks that pass (sync samples are never older than pi_prox; a loose bound) every
# second cycle: cycle 0 checks, cycle 1 (where the failure is) runs loglinear, cycle 2 checks again.
PI_OLD_METHODS = {
    "recompute": {},
    "metrics": {"algorithm.prox_logp_method": "metrics"},
    "loglinear": {"algorithm.prox_logp_method": "loglinear"},
    "auto": {"algorithm.prox_logp_method": "auto", "algorithm.prox_check_every": 2, "algorithm.prox_max_is_err": 10.0},
}


def recording_publishes(monkeypatch) -> list[tuple[int, dict]]:
    """From now on every publish to an in-process rollout appends (version, a copy of the weights) to the list."""
    from dppo.trainer.rollout import InProcessRollout

    published, publish = [], InProcessRollout.publish

    def recording(self, state_dict, version):
        published.append((version, weights_of(state_dict)))
        return publish(self, state_dict, version)

    monkeypatch.setattr(InProcessRollout, "publish", recording)
    return published


def weights_of(state_dict) -> dict:
    return {k: v.detach().clone() for k, v in state_dict.items()}


@pytest.mark.parametrize("score_ahead", [False, True], ids=["score_ahead_off", "score_ahead_on"])
@pytest.mark.parametrize("method", list(PI_OLD_METHODS))
def test_a_rollout_failure_mid_cycle_checkpoints_pi_old_and_the_resumed_run_is_bitwise_the_same(
    small_cfg, monkeypatch, method, score_ahead
):
    """The rollout fails at step 2's second trigger: the trainer checkpoints its state there (pi_old of the cycle: the
    ranks' slot 0 where a later trigger reads it, else the weights the rollout was given; auto's switch; the cycle's
    metrics so far), and the resumed run publishes the cycle-start weights as the cycle's version again and ends with
    exactly the weights and metrics of a run that never failed. In sync mode with score-ahead on, trigger 0 takes and
    scores the whole cycle, so no snapshot is taken and pi_old's weights come from the rollout's copy."""
    common = {
        "trainer.total_steps": 3,
        "trainer.checkpoint_every": 10,
        "trainer.output_dir": None,
        "snapshot.score_ahead": score_ahead,
        "actor.lr": 0.05,
        **PI_OLD_METHODS[method],
    }
    out = small_cfg().trainer.output_dir
    published = recording_publishes(monkeypatch)
    clean = PPOTrainer(small_cfg(**{**common, "trainer.output_dir": f"{out}-clean"}))
    clean.fit()
    expected_records, expected_weights = (
        read_metrics(f"{out}-clean/metrics.jsonl"),
        weights(clean.actor_group.local_rank.model),
    )
    cycle_start = dict(published)[1]  # what version 1 was: the weights at step 2's start
    if method == "auto":
        assert [r["prox_approx/method"] for r in expected_records] == [
            1.0,
            0.0,
            1.0,
        ]  # the failure hits loglinear's cycle

    train_trigger = PPOTrainer.train_trigger

    def failing(self, batch, prox_logp=None):
        if (self.global_step, self.local_trigger_step) == (1, 1):
            raise RolloutFailedError("the replay buffer died")
        return train_trigger(self, batch, prox_logp)

    from dppo.trainer.rollout import RolloutFailedError

    monkeypatch.setattr(PPOTrainer, "train_trigger", failing)
    with pytest.raises(
        RolloutFailedError,
        match=r"^the replay buffer died; the trainer's state at step 1, trigger 1 "
        r"is checkpointed in .*step_00000001_trigger_1 ",
    ):
        PPOTrainer(small_cfg(**{**common, "trainer.output_dir": out})).fit()
    monkeypatch.setattr(PPOTrainer, "train_trigger", train_trigger)
    assert names(f"{out}/checkpoints") == ["step_00000001_trigger_1"]
    state = saved_state(f"{out}/checkpoints")
    slot_read = method in ("recompute", "metrics") and not score_ahead  # trigger 1 reads slot 0
    assert state["anchor"] is slot_read
    assert state["pi_old"]["version"] == 1 and state["pi_old"]["weights"] == ("anchor" if slot_read else "file")
    if method == "auto":
        assert state["pi_old"]["method"] == {
            "started": True,
            "switch": {"approx_ok": True, "cycles_since_check": 1, "cycle_errs": [], "cycle_interp": 0.0},
        }

    published.clear()
    resumed = PPOTrainer(small_cfg(**{**common, "trainer.output_dir": out, "trainer.resume": True}))
    assert resumed.resumed_from.name == "step_00000001_trigger_1"
    assert (resumed.global_step, resumed.progress.trigger) == (1, 1)
    resumed.fit()
    version, first = published[0]
    assert version == 1 and first.keys() == cycle_start.keys()
    for name, tensor in first.items():  # never the live weights, a step past the cycle start, labelled version 1
        assert torch.equal(tensor, cycle_start[name]), name
    for name, tensor in weights(resumed.actor_group.local_rank.model).items():
        assert torch.equal(tensor, expected_weights[name]), name
    got, want = without_timing(read_metrics(f"{out}/metrics.jsonl")), without_timing(expected_records)
    assert [{k: (v, b.get(k)) for k, v in a.items() if b.get(k) != v} for a, b in zip(got, want)] == [{}] * len(want)
    assert got == want


# The cycles whose pi_old weights a mid-cycle checkpoint takes from the rollout's copy (pi_old.pt): no slot anchor
# (loglinear; auto in a loglinear cycle), or a cycle scored wholly ahead at trigger 0
PI_OLD_IN_FILE_CASES = {
    "loglinear": {"algorithm.prox_logp_method": "loglinear", "snapshot.score_ahead": False},
    "auto": {**PI_OLD_METHODS["auto"], "snapshot.score_ahead": False},
    "recompute_scored_ahead": {"snapshot.score_ahead": True},
}


@pytest.mark.parametrize("case", list(PI_OLD_IN_FILE_CASES))
def test_a_buffer_that_dies_in_the_end_of_cycle_publish_leaves_pi_old_of_the_cycle_and_the_run_resumes_bitwise(
    small_cfg, monkeypatch, case
):
    """The replay buffer dies while step 2's weights are published as version 2 (every trigger of the cycle done): the
    checkpoint written after the failure holds the cycle's pi_old as version 1's weights (what the rollout last
    took), never version 2's under version 1's label; the resumed run publishes them as version 1, then version 2,
    and ends with the weights and metrics of a run that never failed."""
    from dppo.checkpoint.layout import PI_OLD_FILE
    from dppo.trainer.rollout import RolloutFailedError
    from dppo.workers.rollout.replay_buffer import ReplayBufferCore

    common = {
        "trainer.total_steps": 3,
        "trainer.checkpoint_every": 10,
        "trainer.output_dir": None,
        "actor.lr": 0.05,
        **PI_OLD_IN_FILE_CASES[case],
    }
    out = small_cfg().trainer.output_dir
    published = recording_publishes(monkeypatch)
    clean = PPOTrainer(small_cfg(**{**common, "trainer.output_dir": f"{out}-clean"}))
    clean.fit()
    expected_records = read_metrics(f"{out}-clean/metrics.jsonl")
    expected_weights = weights(clean.actor_group.local_rank.model)
    versions = dict(published)
    assert not all(torch.equal(versions[1][k], versions[2][k]) for k in versions[1])  # the two differ

    core_publish = ReplayBufferCore.publish

    def dying(self, weights, version, fingerprint=None):
        if version == 2:
            raise RolloutFailedError("the replay buffer died")
        return core_publish(self, weights, version, fingerprint)

    monkeypatch.setattr(ReplayBufferCore, "publish", dying)
    with pytest.raises(
        RolloutFailedError,
        match=r"^the replay buffer died; the trainer's state at step 1, trigger 2 is checkpointed in "
        r".*step_00000001_trigger_2 ",
    ):
        PPOTrainer(small_cfg(**{**common, "trainer.output_dir": out})).fit()
    monkeypatch.setattr(ReplayBufferCore, "publish", core_publish)
    checkpoint = Path(out) / "checkpoints" / "step_00000001_trigger_2"
    state = saved_state(checkpoint.parent)
    assert state["pi_old"]["version"] == 1 and state["pi_old"]["weights"] == "file"
    pi_old = torch.load(checkpoint / PI_OLD_FILE, weights_only=True)
    assert pi_old.keys() == versions[1].keys()
    for name, tensor in pi_old.items():  # version 1's weights, not version 2's that the buffer never took
        assert torch.equal(tensor, versions[1][name]), f"pi_old.pt's {name} is not version 1's"

    published.clear()
    resumed = PPOTrainer(small_cfg(**{**common, "trainer.output_dir": out, "trainer.resume": True}))
    assert (resumed.global_step, resumed.progress.trigger) == (1, 2)
    resumed.fit()
    assert [version for version, _ in published] == [1, 2, 3]
    for version, state_dict in published[:2]:
        for name, tensor in state_dict.items():
            assert torch.equal(tensor, versions[version][name]), f"version {version}'s {name}"
    for name, tensor in weights(resumed.actor_group.local_rank.model).items():
        assert torch.equal(tensor, expected_weights[name]), name
    assert without_timing(read_metrics(f"{out}/metrics.jsonl")) == without_timing(expected_records)


class _Payload:
    """Unpickling it writes a file: what a hostile checkpoint would do."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('pwned')",))


def forge(checkpoint) -> None:
    """Seal a tampered checkpoint as its writer would: manifest hashes and the run's ledger updated to match (what
    someone who can write the run's directory can do)."""
    manifest = json.loads((checkpoint / ckpt.MANIFEST).read_text())
    for name, entry in manifest["files"].items():
        entry["sha256"], entry["bytes"] = ckpt.sha256_file(checkpoint / name), (checkpoint / name).stat().st_size
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    (checkpoint / ckpt.MANIFEST).write_bytes(data)
    ledger_path = checkpoint.parent / ckpt.LEDGER
    ledger = json.loads(ledger_path.read_text())
    ledger["checkpoints"][checkpoint.name]["manifest_sha256"] = hashlib.sha256(data).hexdigest()
    ledger_path.write_text(json.dumps(ledger))


def test_a_forged_actor_checkpoint_runs_no_code_on_resume(small_cfg, tmp_path):
    """DCP reads .metadata with pickle.load; dppo's reader allows DCP's own metadata types only, so even a checkpoint
    whose manifest and ledger entry were forged to match cannot run code."""
    common = {"trainer.checkpoint_every": 1, "algorithm.prox_anchor": "current"}
    PPOTrainer(small_cfg(**{"trainer.total_steps": 1, **common})).fit()
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000001"
    marker = tmp_path / "pwned"
    (checkpoint / ACTOR_DIR / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    forge(checkpoint)
    with pytest.raises(ckpt.CheckpointError, match=r"was not loaded: checkpoint metadata refers to builtins.exec"):
        PPOTrainer(small_cfg(**{"trainer.total_steps": 2, "trainer.resume": True, **common}))
    assert not marker.exists()


def test_dcp_values_load_without_running_code(tmp_path):
    """DCP's own planner loads non-tensor values with torch.load(weights_only=False); dppo's does not."""
    from types import SimpleNamespace

    from dppo.checkpoint.shards import UnsafeCheckpointError, safe_reader_classes

    _, planner_cls = safe_reader_classes()
    planner = planner_cls()
    planner.flatten_state_dict, planner.state_dict = False, {}
    item = SimpleNamespace(dest_index=SimpleNamespace(fqn="optimizer.param_groups.0.lr"))
    payload = io.BytesIO()
    torch.save(_Payload(tmp_path / "pwned"), payload)
    with pytest.raises(UnsafeCheckpointError, match="optimizer.param_groups.0.lr"):
        planner.load_bytes(item, io.BytesIO(payload.getvalue()))
    assert not (tmp_path / "pwned").exists()
    value = io.BytesIO()
    torch.save({"lr": 0.5, "betas": (0.9, 0.99)}, value)
    value.seek(0)
    planner.load_bytes(item, value)  # plain values still load
    assert planner.state_dict["optimizer.param_groups.0.lr"] == {"lr": 0.5, "betas": (0.9, 0.99)}


def test_a_mid_cycle_checkpoint_of_an_older_dppo_without_pi_old_resumes_and_says_what_it_loses(
    small_cfg, monkeypatch, caplog
):
    """A checkpoint written before the pi_old record existed (loglinear: no anchor, no pi_old.pt) still resumes; one
    warning line says the rest of its cycle samples with the live weights under the cycle's version."""
    from dppo.checkpoint.layout import PI_OLD_FILE
    from dppo.trainer.rollout import InProcessRollout, RolloutFailedError

    common = {
        "trainer.total_steps": 3,
        "trainer.checkpoint_every": 10,
        "snapshot.score_ahead": False,
        "algorithm.prox_logp_method": "loglinear",
    }
    fetch, calls = InProcessRollout.fetch, []

    def failing_fetch(self, num_groups, trainer_version):
        calls.append(trainer_version)
        if len(calls) == 4:  # step 2 (version 1), trigger 1
            raise RolloutFailedError("the replay buffer died")
        return fetch(self, num_groups, trainer_version)

    monkeypatch.setattr(InProcessRollout, "fetch", failing_fetch)
    with pytest.raises(RolloutFailedError):
        PPOTrainer(small_cfg(**common)).fit()
    monkeypatch.setattr(InProcessRollout, "fetch", fetch)
    out = Path(small_cfg().trainer.output_dir)
    checkpoints = out / "checkpoints"
    path = checkpoints / "step_00000001_trigger_1"
    state = torch.load(path / TRAINER_FILE, weights_only=True)
    del state["pi_old"]
    torch.save(state, path / TRAINER_FILE)
    (path / PI_OLD_FILE).unlink()
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    del manifest["files"][PI_OLD_FILE]
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
    forge(path)

    with caplog.at_level("WARNING", logger="dppo.checkpoint"):
        resumed = PPOTrainer(small_cfg(**common, **{"trainer.resume": True}))
    lines = [r.getMessage() for r in caplog.records if "older dppo" in r.getMessage()]
    assert len(lines) == 1 and "step_00000001_trigger_1" in lines[0] and "labelled version 1" in lines[0], lines
    assert (resumed.global_step, resumed.progress.trigger) == (1, 1)
    resumed.fit()
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]


# what recorded_run wraps, as they are before any test patches them
BUFFER_CORE, REWARD_EXTRAS, RUN_CYCLE = local_source.buffer_core, base._reward_extras, base.BaseTrainer.run_cycle


def recorded_run(cfg, monkeypatch) -> tuple[list, list, list]:
    """fit() a PPOTrainer for cfg (separate_async without Ray: local worker processes, the replay buffer here):
    (version, consumed, next_grant) of each replay buffer made, the grant indices each trigger trained on, and
    (consumed, next_grant) after each step."""
    starts, trained, after = [], [], []

    def recording_core(settings, start, *args):
        starts.append((start.version, start.consumed, start.next_grant))
        return BUFFER_CORE(settings, start, *args)

    def recording_cycle(self):
        record = RUN_CYCLE(self)
        after.append((self.rollout_start.consumed, self.rollout_start.next_grant))
        return record

    monkeypatch.setattr(local_source, "buffer_core", recording_core)
    monkeypatch.setattr(
        base, "_reward_extras", lambda groups: trained.append([g.index for g in groups]) or REWARD_EXTRAS(groups)
    )
    monkeypatch.setattr(base.BaseTrainer, "run_cycle", recording_cycle)
    PPOTrainer(cfg).fit()
    return starts, trained, after


def test_a_run_whose_triggers_train_on_fewer_groups_resumes_with_the_groups_it_consumed(small_cfg, monkeypatch):
    """algorithm.filter_groups with max_num_gen_batches=2, and one group in four varying: each trigger (G = 2) takes
    4 groups and trains on 1, so a step consumes 2 groups, not B = 4. A run stopped after step 2's checkpoint and
    resumed starts its replay buffer with the count (the wait budget's base) and goes on with the grants of the run
    that never stopped; a checkpoint of an older dppo, without the count, still resumes (counted as if full)."""
    monkeypatch.setattr(filter_groups, "keeps", lambda group, metric: group.index % 4 == 3)
    out = Path(small_cfg().trainer.output_dir)
    common = {
        "trainer.mode": "separate_async",
        "trainer.checkpoint_every": 2,
        "algorithm.filter_groups.enable": True,
        "algorithm.filter_groups.max_num_gen_batches": 2,
        "replay.max_off_policy_threshold": 3,  # the run's last version: no group is ever dropped, whatever the timing
    }
    starts, trained, after = recorded_run(
        small_cfg(**common, **{"trainer.total_steps": 4, "trainer.output_dir": f"{out}-whole"}), monkeypatch
    )
    assert starts == [(0, 0, 0)]
    assert trained == [[3], [7], [11], [15], [19], [23], [27], [31]]
    assert after == [(2, 8), (4, 16), (6, 24), (8, 32)]

    assert recorded_run(small_cfg(**common), monkeypatch)[2] == after[:2]
    assert saved_state(out / "checkpoints")["rollout"]["consumed"] == 4
    resumed = recorded_run(small_cfg(**common, **{"trainer.total_steps": 4, "trainer.resume": True}), monkeypatch)
    assert resumed == ([(2, 4, 16)], trained[4:], after[2:])

    path = out / "checkpoints" / "step_00000004"  # as an older dppo wrote it: no consumed count
    state = torch.load(path / TRAINER_FILE, weights_only=True)
    del state["rollout"]["consumed"]
    torch.save(state, path / TRAINER_FILE)
    forge(path)
    older = PPOTrainer(small_cfg(**common, **{"trainer.total_steps": 5, "trainer.resume": True}))
    try:
        assert older.resumed_from == path
        assert (older.rollout_start.consumed, older.rollout_start.next_grant) == (4 * 4, 32)  # 4 versions x B
    finally:
        older.close()


def test_an_older_mid_cycle_checkpoint_counts_what_its_cycle_consumed(small_cfg, tmp_path):
    """A mid-cycle trainer.pt of a dppo that kept no consumed count, read into the current layout (RunCheckpoints) and
    into the loop's state (TrainerState): full mini-batches of G groups for the versions and the cycle's triggers done,
    the groups held ahead, and the kept groups of the draw pending; the rest of the state as it was saved."""
    from dppo.batch import Group
    from dppo.checkpoint.run import RunCheckpoints
    from dppo.trainer.base import checkpoint_settings
    from dppo.trainer.state import CycleProgress, Draw, HeldBatch, RolloutStart, TrainerState

    def groups(count: int) -> list[Group]:
        return [
            Group(torch.zeros(3, dtype=torch.long), *[torch.zeros(2, 4)] * 3, torch.zeros(2), 5) for _ in range(count)
        ]

    cfg = small_cfg(**{"trainer.parameter_sync_step": 4, "trainer.train_batch_size": 8})  # G = 2 groups a trigger
    progress = CycleProgress(
        trigger=2,
        ahead=[HeldBatch(groups(3), torch.zeros(6, 4))],
        pending=Draw(groups(3), [True, False, True], dropped=1),
    )
    saved = TrainerState(5, 5, progress, RolloutStart(5, consumed=999, next_grant=60, dropped_total=7)).to_state(1.5)
    del saved["rollout"]["consumed"]
    state = TrainerState.from_state(RunCheckpoints(checkpoint_settings(cfg), tmp_path)._run_state(saved))
    assert state.rollout_start.consumed == 5 * 8 + 2 * 2 + 3 + 2
    assert (state.global_step, state.version, state.progress.trigger, state.progress.elapsed_s) == (5, 5, 2, 1.5)
    assert (state.rollout_start.version, state.rollout_start.next_grant, state.rollout_start.dropped_total) == (
        5,
        60,
        7,
    )
    assert state.progress.pending.kept == [True, False, True] and state.progress.ahead[0].num_groups == 3
