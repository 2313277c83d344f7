"""The exit codes of `dppo train` as documented: one table (--help and docs/troubleshooting.md say the same), and a
case for every code of it that produces that code."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dppo.cli import EXIT_CODES, exit_code_help, main

from tiny_run import small_overrides  # tests/tiny_run.py (tests/conftest.py puts tests/ on sys.path)

REPO = Path(__file__).resolve().parents[2]


def finished(tmp_path, monkeypatch) -> list[str]:
    return small_overrides(tmp_path)


def rollout_failed(tmp_path, monkeypatch) -> list[str]:
    from dppo.trainer.rollout import InProcessRollout, RolloutFailedError

    def dead(self, num_groups, trainer_version):
        raise RolloutFailedError("the replay buffer died")

    monkeypatch.setattr(InProcessRollout, "fetch", dead)
    return small_overrides(tmp_path)


def bad_config(tmp_path, monkeypatch) -> list[str]:
    return small_overrides(tmp_path, **{"trainer.total_steps": -1})


def output_dir_unwritable(tmp_path, monkeypatch) -> list[str]:
    (tmp_path / "a_file").write_text("not a directory")
    return small_overrides(tmp_path, **{"trainer.output_dir": tmp_path / "a_file" / "run"})


def no_usable_checkpoint(tmp_path, monkeypatch) -> list[str]:
    planted = tmp_path / "run" / "checkpoints" / "step_00000001"  # not written by this run: never trusted
    planted.mkdir(parents=True)
    (planted / "trainer.pt").write_bytes(b"someone else's")
    return small_overrides(tmp_path, **{"trainer.resume": True})


def cluster_unreachable(tmp_path, monkeypatch) -> list[str]:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return small_overrides(tmp_path, **{"ray.enabled": True, "ray.address": "127.0.0.1:1"})  # nothing listens there


def missing_data_file(tmp_path, monkeypatch) -> list[str]:
    model = tmp_path / "model"  # text data needs a model directory (the config's rule, exit 2): one is there
    model.mkdir()
    (model / "config.json").write_text("{}")
    return small_overrides(tmp_path, **{"data.train_files": tmp_path / "no_such.parquet", "model.path": model})


def unexpected(tmp_path, monkeypatch) -> list[str]:
    import dppo.launch.run

    monkeypatch.setattr(dppo.launch.run, "run", lambda cfg, out=None: 1 / 0)
    return small_overrides(tmp_path)


def replay_differs(tmp_path, monkeypatch) -> list[str]:
    """A finished run whose schedule was edited: its first trigger's second group moved to the mini-batch taken ahead
    for the next trigger (and that one's first group back): the replay trains other mini-batches and ends elsewhere."""
    assert main(["train", *small_overrides(tmp_path)]) == 0
    schedule = tmp_path / "run" / "schedule.jsonl"
    header, first, *rest = schedule.read_text().splitlines()
    line = json.loads(first)
    fetched, ahead = line["takes"][0]["groups"], line["takes"][1]["groups"]
    fetched[1], ahead[0] = ahead[0], fetched[1]
    schedule.write_text("\n".join([header, json.dumps(line), *rest]) + "\n")
    return ["replay", str(tmp_path / "run"), "--out", str(tmp_path / "replay")]


IN_PROCESS = {
    0: finished,
    1: rollout_failed,
    2: bad_config,
    3: output_dir_unwritable,
    4: no_usable_checkpoint,
    5: cluster_unreachable,
    6: missing_data_file,
    7: replay_differs,
    70: unexpected,
}
SIGNALS = {130: signal.SIGINT, 143: signal.SIGTERM}


def test_every_code_of_the_table_has_a_case_below():
    assert sorted([*IN_PROCESS, *SIGNALS, 141]) == [code for code, _ in EXIT_CODES]


def test_a_closed_stdout_is_141_without_a_traceback():
    """`dppo train --help | head`: the reader is gone before dppo writes (the pipe's read end is closed first)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "dppo", "train", "--help"],
            cwd=REPO,
            env=env,
            text=True,
            stdout=write_end,
            stderr=subprocess.PIPE,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert proc.returncode == 141 and proc.stderr == "", proc.stderr[-2000:]


@pytest.mark.parametrize("code", sorted(IN_PROCESS))
def test_each_code_is_produced_by_its_case_with_one_line(code, tmp_path, monkeypatch, capsys):
    args = IN_PROCESS[code](tmp_path, monkeypatch)
    command = [] if args[0] == "replay" else ["train"]
    assert main([*command, *args]) == code
    captured = capsys.readouterr()
    err = [line for line in captured.err.strip().splitlines() if line.startswith("dppo: ")]
    if code == 7:  # not an error of the command: the comparison's lines say where the replay differs
        assert "weights: differ first at" in captured.out and "metrics: " in captured.out
    if code in (0, 7):
        assert not any(line.startswith("dppo: error") for line in err)
    elif code == 70:
        assert err[-1].startswith("dppo: internal error: ZeroDivisionError")
    else:
        assert err[-1].startswith("dppo: error: ") and len([e for e in err if "error" in e.split(":")[1]]) == 1


@pytest.mark.parametrize("code", sorted(SIGNALS))
def test_a_signal_mid_run_is_its_code(code, tmp_path):
    args = small_overrides(tmp_path, **{"trainer.total_steps": 100_000})
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dppo", "train", *args],
        cwd=REPO,
        env=env,
        text=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(SIGNALS[code])
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code, stderr[-2000:]


def test_help_and_the_docs_give_the_same_table():
    """One table: each row of docs/troubleshooting.md's exit codes says what --help says (markdown aside)."""
    docs = (REPO / "docs" / "troubleshooting.md").read_text()
    rows = dict(re.findall(r"^\| (\d+) \| (.+) \|$", docs, re.M))
    plain = {int(code): re.sub(r"\[([^]]+)\]\([^)]+\)", r"\1", text).replace("`", "") for code, text in rows.items()}
    assert plain == dict(EXIT_CODES)
    for code, _ in EXIT_CODES:
        assert re.search(rf"^\s+{code}  ", exit_code_help(), re.M), code
