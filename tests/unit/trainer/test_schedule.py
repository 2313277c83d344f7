"""The schedule's file: a torn last line (a SIGKILL mid-write) is left out, a damaged one is one line naming it, a
schedule that does not start at the run's first step is refused, and a samples file that cannot be written stops the
run at the next commit or flush instead of leaving lines without their samples."""

from __future__ import annotations

import json

import pytest
import torch

from dppo.batch import Group
from dppo.trainer.schedule import SCHEDULE_FILE, Schedule, ScheduleError, ScheduleRecorder, read_samples


def group(index: int) -> Group:
    ticket = {"first": index, "size": 1, "version": 0, "looks": []}
    return Group(
        torch.tensor([1, 2]), torch.tensor([[3, 4]]), torch.ones(1, 2, dtype=torch.bool), torch.zeros(1, 2),
        torch.tensor([0.5]), 0, index, ticket=ticket,
    )  # fmt: skip


def test_a_torn_last_line_is_left_out_and_a_damaged_one_named(tmp_path):
    recorder = ScheduleRecorder(tmp_path, seed=0)
    recorder.fresh()
    recorder.took("fetch", 1, ([group(0)], 0))
    recorder.commit(1, 0, 0)
    path = tmp_path / SCHEDULE_FILE
    with open(path, "a") as f:
        f.write('{"step": 1, "trigger": 1, "vers')  # killed mid-write
    assert [t.groups for t in Schedule.read(tmp_path).takes] == [[(0, 0)]]
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], "not json", lines[1]]) + "\n")
    with pytest.raises(ScheduleError, match="line 2 is not JSON"):
        Schedule.read(tmp_path)


def test_a_schedule_that_starts_after_the_first_step_is_refused(tmp_path):
    recorder = ScheduleRecorder(tmp_path, seed=0)
    recorder.resumed(tmp_path / "a_checkpoint_without_one", step=4)
    assert json.loads((tmp_path / SCHEDULE_FILE).read_text())["from_step"] == 4
    with pytest.raises(ScheduleError, match="starts at global step 5"):
        Schedule.read(tmp_path)


def test_samples_are_written_before_their_line_and_a_failed_write_stops_the_run(tmp_path):
    recorder = ScheduleRecorder(tmp_path, seed=0, samples=True)
    recorder.fresh()
    recorder.took("fetch", 2, ([group(0), group(1)], 0))
    recorder.commit(1, 0, 0)
    recorder.flush()
    stored = read_samples(tmp_path / "samples" / "step_00000001_trigger_0.npz")
    assert [g.index for g in stored] == [0, 1] and torch.equal(stored[1].responses, group(1).responses)
    assert stored[0].ticket == group(0).ticket
    (tmp_path / "samples").rename(tmp_path / "elsewhere")
    (tmp_path / "samples").write_text("a file where the directory was")
    recorder.took("fetch", 1, ([group(2)], 0))
    recorder.commit(1, 1, 0)
    with pytest.raises(ScheduleError, match="writing the run's samples failed"):
        recorder.flush()
    assert len((tmp_path / SCHEDULE_FILE).read_text().splitlines()) == 2  # the header and the first line only
