"""The ledger stays true: a SIGKILL at each point of a save leaves the previous state or a usable new checkpoint,
entries whose checkpoint fails verification are dropped, and retention keeps the newest valid checkpoints."""

import json
import logging
import os
import signal
import shutil

import pytest
import torch

from dppo.checkpoint import store as ckpt

# points after which the new checkpoint is in place and must be the one found; before them, the previous one
IN_PLACE_FROM = "renamed"


def save(directory, step, tag="", keep=2):
    """A checkpoint of step whose one file says which save wrote it (tag tells a redone step from the first)."""
    payload = f"step {step}{tag}".encode()
    return ckpt.save_checkpoint(directory, step, step, lambda d: (d / "trainer.pt").write_bytes(payload), keep=keep)


def found(directory) -> str:
    return ckpt.CheckpointDir(directory).newest(lambda path, manifest: (path / "trainer.pt").read_text())[1]


def killed_at(point: str, act) -> None:
    """Run act() in a forked child with the kill hook set to point; the child must die of SIGKILL there."""
    pid = os.fork()
    if pid == 0:  # the child: no pytest teardown, whatever happens
        try:
            os.environ[ckpt.KILL_AT_ENV] = point
            act()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"{point}: the save never reached it"


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "dppo.checkpoint"]


def on_disk(directory) -> list[str]:
    return sorted(os.listdir(directory))


@pytest.mark.parametrize("point", [p for p in ckpt.SAVE_POINTS if p != "aside"])
def test_a_kill_at_any_point_of_a_save_leaves_the_previous_or_the_new_checkpoint(tmp_path, point, caplog):
    save(tmp_path, 1)
    save(tmp_path, 2)
    killed_at(point, lambda: save(tmp_path, 3))  # the third save also retires step 1 (keep=2)
    in_place = ckpt.SAVE_POINTS.index(point) >= ckpt.SAVE_POINTS.index(IN_PLACE_FROM)
    with caplog.at_level(logging.WARNING, logger="dppo.checkpoint"):
        assert found(tmp_path) == ("step 3" if in_place else "step 2")
    assert warnings_of(caplog) == []  # a kill mid-save is nothing to warn about
    # the ledger lists exactly the checkpoint directories there are, and nothing half-written is left
    recorded = [i.name for i in ckpt.CheckpointDir(tmp_path).recorded()]
    assert on_disk(tmp_path) == sorted([ckpt.LEDGER, *recorded])
    assert "step_00000002" in recorded and ("step_00000003" in recorded) == in_place
    # and the run goes on: the next save keeps the two newest
    save(tmp_path, 4)
    assert on_disk(tmp_path) == [ckpt.LEDGER, "step_00000003" if in_place else "step_00000002", "step_00000004"]
    assert found(tmp_path) == "step 4"


@pytest.mark.parametrize("point", ["pending", "aside", "renamed", "recorded"])
def test_a_kill_while_replacing_a_checkpoint_of_the_same_name_keeps_one_of_them(tmp_path, point):
    """A step redone after a resume saves under a name the ledger already lists: the old one is moved aside
    before the new one is renamed into place; a kill in between puts the old one back."""
    save(tmp_path, 1)
    save(tmp_path, 2)
    killed_at(point, lambda: save(tmp_path, 2, tag=" redone"))
    in_place = ckpt.SAVE_POINTS.index(point) >= ckpt.SAVE_POINTS.index(IN_PLACE_FROM)
    assert found(tmp_path) == ("step 2 redone" if in_place else "step 2")
    assert on_disk(tmp_path) == [ckpt.LEDGER, "step_00000001", "step_00000002"]
    assert [i.name for i in ckpt.CheckpointDir(tmp_path).recorded()] == ["step_00000001", "step_00000002"]


def test_a_save_that_fails_after_recording_it_as_pending_changes_nothing(tmp_path, monkeypatch):
    save(tmp_path, 1)
    save(tmp_path, 2)
    ledger_before = (tmp_path / ckpt.LEDGER).read_bytes()

    def unreadable(path, record):
        raise ckpt.CheckpointError("read back failed")

    monkeypatch.setattr(ckpt, "verify_checkpoint", unreadable)  # the read-back after the rename fails
    with pytest.raises(ckpt.CheckpointError, match="read back failed"):
        save(tmp_path, 2, tag=" redone")
    monkeypatch.undo()
    assert (tmp_path / ckpt.LEDGER).read_bytes() == ledger_before
    assert on_disk(tmp_path) == [ckpt.LEDGER, "step_00000001", "step_00000002"]
    assert found(tmp_path) == "step 2"


def plant(directory, name: str, like: str, entry_of: str) -> None:
    """A directory `name` copied from checkpoint `like`, listed in the ledger with `entry_of`'s entry (as a ledger
    edited by hand or by another run would): its manifest does not hash to what the ledger holds."""
    shutil.copytree(directory / like, directory / name)
    ledger = json.loads((directory / ckpt.LEDGER).read_text())
    ledger["checkpoints"][name] = ledger["checkpoints"][entry_of]
    (directory / ckpt.LEDGER).write_text(json.dumps(ledger))


def test_ledger_entries_that_fail_verification_are_dropped_and_never_count_toward_retention(tmp_path, caplog):
    save(tmp_path, 1)
    save(tmp_path, 2)
    plant(tmp_path, "step_00000009", like="step_00000002", entry_of="step_00000001")
    ledger = json.loads((tmp_path / ckpt.LEDGER).read_text())
    ledger["checkpoints"]["step_00000000"] = ledger["checkpoints"]["step_00000001"]  # names no directory at all
    (tmp_path / ckpt.LEDGER).write_text(json.dumps(ledger))

    with caplog.at_level(logging.WARNING, logger="dppo.checkpoint"):
        assert found(tmp_path) == "step 2"
    lines = warnings_of(caplog)
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"skipped checkpoint {tmp_path / 'step_00000009'}: manifest.json differs")
    assert lines[0].endswith(f"(dropped from {ckpt.LEDGER})")
    assert lines[1] == f"dropped step_00000000 from {ckpt.LEDGER}: {ckpt.LEDGER} lists it but its directory is missing"
    assert set(json.loads((tmp_path / ckpt.LEDGER).read_text())["checkpoints"]) == {"step_00000001", "step_00000002"}

    # retention keeps the two newest valid checkpoints, and never deletes the planted directory
    save(tmp_path, 3)
    save(tmp_path, 4)
    assert [i.name for i in ckpt.CheckpointDir(tmp_path).recorded()] == ["step_00000003", "step_00000004"]
    assert on_disk(tmp_path) == [ckpt.LEDGER, "step_00000003", "step_00000004", "step_00000009"]


def test_a_checkpoint_left_pending_by_a_kill_is_loaded_as_the_tensors_it_holds(tmp_path):
    """Through torch.save as the trainer writes it: the pending entry is promoted and the tensors read back."""
    state = {"global_step": 5, "weights": torch.arange(4.0)}
    killed_at("renamed", lambda: ckpt.save_checkpoint(tmp_path, 5, 5, lambda d: torch.save(state, d / "t.pt")))
    assert json.loads((tmp_path / ckpt.LEDGER).read_text())["checkpoints"]["step_00000005"]["pending"] is True
    path, loaded = ckpt.CheckpointDir(tmp_path).newest(lambda p, m: ckpt.load_torch(p / "t.pt"))
    assert torch.equal(loaded["weights"], state["weights"])
    assert "pending" not in json.loads((tmp_path / ckpt.LEDGER).read_text())["checkpoints"]["step_00000005"]
