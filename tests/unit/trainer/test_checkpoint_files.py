"""Checkpoint directories: manifest, atomic staging, the run's ledger, trust, fallback, retention, hostile pickles."""

import hashlib
import json
import logging
import os
import pickle

import pytest
import torch

from dppo.checkpoint import store as ckpt


def write_files(payload: dict[str, bytes]):
    """A write_fn putting several files (one in a subdirectory, as torch.distributed.checkpoint shards may be)."""

    def write(staging):
        for name, data in payload.items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_bytes(data)

    return write


def save_step(directory, step, keep=2, trigger=0):
    state = {"global_step": step, "weights": torch.full((3,), float(step))}
    return ckpt.save_checkpoint(directory, step, step, lambda d: torch.save(state, d / "trainer.pt"), trigger, keep)


def load_step(path, manifest):
    state = ckpt.load_torch(path / "trainer.pt")
    return state["global_step"]


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "dppo.checkpoint"]


def test_a_checkpoint_is_a_sealed_directory_listing_every_file(tmp_path):
    files = {"trainer.pt": b"t" * 10, "shards/__0_0.distcp": b"rank0", "shards/__1_0.distcp": b"rank1!"}
    path = ckpt.save_checkpoint(tmp_path, 7, 3, write_files(files))
    assert path == tmp_path / "step_00000007" and path.is_dir()
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    assert (manifest["step"], manifest["trigger"], manifest["version"]) == (7, 0, 3)
    assert manifest["files"] == {
        name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()} for name, data in files.items()
    }
    ledger = json.loads((tmp_path / ckpt.LEDGER).read_text())
    recorded = ledger["checkpoints"]["step_00000007"]
    assert recorded["manifest_sha256"] == hashlib.sha256((path / ckpt.MANIFEST).read_bytes()).hexdigest()
    assert sorted(os.listdir(tmp_path)) == [ckpt.LEDGER, "step_00000007"]  # no staging directory left behind
    mid = ckpt.save_checkpoint(tmp_path, 7, 3, write_files({"trainer.pt": b"x"}), trigger=2, keep=5)
    assert mid.name == "step_00000007_trigger_2"
    assert ckpt.CheckpointDir(tmp_path).recorded() == [ckpt.CheckpointId(7), ckpt.CheckpointId(7, 2)]


def test_a_failed_write_leaves_nothing_and_keeps_the_older_checkpoints(tmp_path):
    save_step(tmp_path, 1)
    before = (tmp_path / ckpt.LEDGER).read_bytes()

    def failing(staging):
        (staging / "trainer.pt").write_bytes(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        ckpt.save_checkpoint(tmp_path, 2, 2, failing)
    assert sorted(os.listdir(tmp_path)) == [ckpt.LEDGER, "step_00000001"]
    assert (tmp_path / ckpt.LEDGER).read_bytes() == before
    assert ckpt.CheckpointDir(tmp_path).newest(load_step)[1] == 1


def test_retention_deletes_only_what_the_run_recorded(tmp_path):
    planted = tmp_path / "step_00000000"  # not written by this run: never trusted, never deleted
    planted.mkdir()
    (planted / "trainer.pt").write_bytes(b"someone else's")
    for step in (1, 2, 3):
        save_step(tmp_path, step, keep=2)
    assert sorted(os.listdir(tmp_path)) == [ckpt.LEDGER, "step_00000000", "step_00000002", "step_00000003"]
    assert ckpt.CheckpointDir(tmp_path).recorded() == [ckpt.CheckpointId(2), ckpt.CheckpointId(3)]


def test_untrusted_newer_checkpoints_are_skipped_with_one_warning_each(tmp_path, caplog):
    for step in (1, 2, 3):
        save_step(tmp_path, step, keep=3)
    # 3 is corrupt (a byte flipped), 4 is a planted copy of 2 with the manifest rewritten to step 4 (name and
    # content agree, but the run never recorded it), 5 names step 5 but holds step 2, and a look-alike file.
    data = bytearray((tmp_path / "step_00000003" / "trainer.pt").read_bytes())
    data[-20] ^= 0xFF
    (tmp_path / "step_00000003" / "trainer.pt").write_bytes(bytes(data))
    for name in ("step_00000004", "step_00000005"):
        os.system(f"cp -r {tmp_path / 'step_00000002'} {tmp_path / name}")
    manifest = json.loads((tmp_path / "step_00000004" / ckpt.MANIFEST).read_text())
    (tmp_path / "step_00000004" / ckpt.MANIFEST).write_text(json.dumps({**manifest, "step": 4, "version": 4}))
    ledger = json.loads((tmp_path / ckpt.LEDGER).read_text())  # 5: recorded, but the entry is 2's
    ledger["checkpoints"]["step_00000005"] = ledger["checkpoints"]["step_00000002"]
    (tmp_path / ckpt.LEDGER).write_text(json.dumps(ledger))
    (tmp_path / "step_00000011.pt").write_bytes(b"an old-style file named like a newer step")

    with caplog.at_level(logging.WARNING, logger="dppo.checkpoint"):
        path, step = ckpt.CheckpointDir(tmp_path).newest(load_step)
    assert (path.name, step) == ("step_00000002", 2)  # the newest one that checks out
    lines = warnings_of(caplog)
    assert len(lines) == 4
    expected = [
        ("step_00000011.pt", "not a checkpoint name"),
        ("step_00000005", "holds step 2 trigger 0 version 2"),
        ("step_00000004", "not written by this run"),
        ("step_00000003", "content does not match"),
    ]
    for line, (name, reason) in zip(lines, expected):
        assert line.startswith(f"skipped checkpoint {tmp_path / name}: ") and reason in line, line


def test_a_pickle_payload_is_never_run_even_when_the_ledger_vouches_for_it(tmp_path, caplog):
    """The planted file is recorded with correct hashes (as if the ledger had been rewritten): it still only ever
    reaches torch.load(weights_only=True), which refuses it; the older checkpoint is used."""
    marker = tmp_path / "payload_ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    save_step(tmp_path, 1)
    hostile = ckpt.save_checkpoint(
        tmp_path, 2, 2, lambda d: (d / "trainer.pt").write_bytes(pickle.dumps(Payload(), protocol=2))
    )
    with caplog.at_level(logging.WARNING, logger="dppo.checkpoint"):
        path, step = ckpt.CheckpointDir(tmp_path).newest(load_step)
    assert not marker.exists()
    assert (path.name, step) == ("step_00000001", 1)
    [line] = warnings_of(caplog)
    assert line.startswith(f"skipped checkpoint {hostile}: cannot read trainer.pt as tensors and plain data")


def test_no_checkpoint_is_none_and_no_usable_one_is_an_error(tmp_path, caplog):
    assert ckpt.CheckpointDir(tmp_path / "missing").newest(load_step) is None
    save_step(tmp_path, 1)
    (tmp_path / "step_00000001" / "trainer.pt").write_bytes(b"")
    with pytest.raises(ckpt.CheckpointError, match=r"no usable checkpoint .* skipped 1 \(newest: step_00000001: "):
        ckpt.CheckpointDir(tmp_path).newest(load_step)


def test_a_staging_leftover_is_ignored_and_cleaned(tmp_path):
    save_step(tmp_path, 1)
    leftover = tmp_path / ".staging.step_00000002.abc"  # a run killed while writing step 2
    leftover.mkdir()
    (leftover / "trainer.pt").write_bytes(b"torn")
    assert ckpt.CheckpointDir(tmp_path).newest(load_step)[1] == 1
    assert not leftover.exists()
