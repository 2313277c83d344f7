"""A checkpoint that cannot be written: the earlier ones intact, no staging left, one warning line with the cause in
words, training goes on; two in a row stop the run with one line and exit code 3. Real faults: a small tmpfs
(a full disk) and a file size limit (RLIMIT_FSIZE) on a whole `dppo train`."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dppo.checkpoint import store as ckpt
from dppo.checkpoint.failure import CheckpointAttempts, CheckpointWriteError, size_in_words
from dppo.launch.plan import plan_run
from dppo.launch.preflight import check_checkpoint_space

from tiny_run import small_overrides  # tests/tiny_run.py (tests/conftest.py puts tests/ on sys.path)

KB = 1000
CHECKPOINT_BYTES = 300 * KB  # what each save below writes


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MB tmpfs mounted for the test (a real full disk); needs root, as mount does."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); the file size limit test still runs")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def torch_write(staging: Path) -> None:
    """As the trainer writes trainer.pt: torch.save, which reports a short write without its errno."""
    torch.save({"weights": torch.zeros(CHECKPOINT_BYTES // 4)}, staging / "trainer.pt")


def plain_write(staging: Path) -> None:
    """A plain file write, which reports ENOSPC as an OSError with its errno."""
    (staging / "shard.bin").write_bytes(b"\0" * CHECKPOINT_BYTES)


def fill(disk: Path, leave_bytes: int) -> Path:
    """A ballast file leaving about leave_bytes free on disk."""
    ballast = disk / "ballast"
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    ballast.write_bytes(b"\0" * max(free - leave_bytes, 0))
    return ballast


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("dppo")]


def safetensors_write(staging: Path) -> None:
    """As a checkpoint's transformers model is written: safetensors, whose error is no OSError ("(os error 28)")."""
    from safetensors.torch import save_file

    save_file({"weights": torch.zeros(CHECKPOINT_BYTES // 4)}, str(staging / "model.safetensors"))


@pytest.mark.parametrize(
    "write", [torch_write, plain_write, safetensors_write], ids=["torch.save", "plain write", "safetensors"]
)
def test_a_full_disk_is_one_warning_with_the_free_and_needed_bytes_and_two_in_a_row_stop(small_disk, write, caplog):
    checkpoints = ckpt.CheckpointDir(small_disk / "checkpoints", keep=1)
    attempts = CheckpointAttempts(checkpoints, lambda: CHECKPOINT_BYTES)

    def save(step):
        return attempts.save(lambda: checkpoints.save(step, step, write), ckpt.CheckpointId(step).name)

    assert save(1) == small_disk / "checkpoints" / "step_00000001"
    ballast = fill(small_disk, leave_bytes=100 * KB)
    with caplog.at_level(logging.WARNING, logger="dppo"):
        assert save(2) is None
    [line] = warnings_of(caplog)
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    assert line == (
        f"checkpoint {small_disk}/checkpoints/step_00000002 could not be written: no space left on device: "
        f"{size_in_words(free)} free, the checkpoint needs about 300 KB; the checkpoints before it are "
        "intact and training goes on (the next checkpoint is tried as usual)"
    )
    assert sorted(os.listdir(small_disk / "checkpoints")) == [ckpt.LEDGER, "step_00000001"]  # no staging left
    assert checkpoints.newest(lambda path, manifest: manifest["step"])[1] == 1

    ballast.unlink()  # space freed: the next checkpoint is written, and the count of failures starts again
    assert save(3) is not None and attempts.failed_in_a_row == 0
    fill(small_disk, leave_bytes=100 * KB)
    assert save(4) is None
    with pytest.raises(
        CheckpointWriteError,
        match=r"^2 checkpoints in a row could not be written, the last one "
        rf"{small_disk}/checkpoints/step_00000005: no space left on device: .* free, the checkpoint "
        r"needs about 300 KB; the run stopped$",
    ):
        save(5)
    assert sorted(os.listdir(small_disk / "checkpoints")) == [ckpt.LEDGER, "step_00000003"]
    assert checkpoints.newest(lambda path, manifest: manifest["step"])[1] == 3


def test_a_bug_in_what_is_saved_is_not_taken_for_a_full_disk(tmp_path):
    checkpoints = ckpt.CheckpointDir(tmp_path)
    attempts = CheckpointAttempts(checkpoints, lambda: CHECKPOINT_BYTES)

    def buggy(staging):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        attempts.save(lambda: checkpoints.save(1, 1, buggy), "step_00000001")
    assert attempts.failed_in_a_row == 0


def test_preflight_warns_when_the_output_dir_has_less_room_than_two_checkpoints(small_disk, small_cfg, caplog):
    cfg = small_cfg(**{"trainer.output_dir": small_disk / "run", "trainer.checkpoint_every": 1})
    source = __import__("dppo.data", fromlist=["make_prompt_source"]).make_prompt_source(cfg)
    assert check_checkpoint_space(plan_run(cfg, source)) is None  # a tiny model's two checkpoints fit in 1 MB
    fill(small_disk, leave_bytes=100 * KB)
    with caplog.at_level(logging.WARNING, logger="dppo"):
        line = check_checkpoint_space(plan_run(cfg, source))
    assert line is not None and warnings_of(caplog) == [line]
    assert line.startswith(f"trainer.output_dir='{small_disk / 'run'}' has ") and "less than two checkpoints" in line
    assert (
        check_checkpoint_space(plan_run(small_cfg(**{"trainer.output_dir": small_disk / "run"}), source)) is None
    )  # none due


def test_a_run_whose_checkpoints_exceed_a_file_size_limit_trains_on_then_stops_with_exit_code_3(tmp_path):
    """`dppo train` under RLIMIT_FSIZE of 100 KB: every file of the run fits but the ranks' shard file (about
    245 KB). The first checkpoint is a warning and step 2 is trained; the second stops the run, one line, code 3."""
    args = small_overrides(tmp_path, **{"trainer.checkpoint_every": 1, "trainer.total_steps": 4})
    script = (
        "import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000)); "
        "from dppo.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3]), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script, "train", *args], capture_output=True, text=True, env=env, timeout=300
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 3, done.stderr
    checkpoints = tmp_path / "run" / "checkpoints"
    cause = "file too large: a file size limit (ulimit -f) of 100 KB is in force, the checkpoint needs about "
    assert lines[0].startswith(f"dppo: warning: checkpoint {checkpoints}/step_00000001 could not be written: {cause}")
    assert lines[1].startswith(
        f"dppo: error: 2 checkpoints in a row could not be written, the last one {checkpoints}/step_00000002: {cause}"
    )
    assert len(lines) == 2 and lines[1].endswith("; the run stopped"), lines
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2  # step 2 was trained
    assert sorted(os.listdir(checkpoints)) == []  # no staging directory, no torn checkpoint, no ledger entry
