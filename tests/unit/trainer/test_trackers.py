"""Trackers (trainer.logger): TensorBoard, W&B offline and an MLflow file store hold metrics.jsonl's scalars at its
steps, the config and the final evaluation; a resumed run continues the same runs; a failing tracker warns once."""

import json
import logging
import math

import numpy as np
import pytest
from tracker_files import mlflow_run, tensorboard_scalars, wandb_offline_run

from dppo.trainer import trackers as tr
from dppo.config import ConfigError

CONFIG = {"trainer": {"seed": 3, "logger": ["console", "tensorboard"]}, "actor": {"lr": 0.001}}
RECORDS = [
    {"step": 1, "version": 1, "critic/score/mean": 0.25, "timing_s/step": 0.5, "rollout_corr/x": 1e-9},
    {"step": 2, "version": 2, "critic/score/mean": 0.75, "timing_s/step": 0.25, "actor/pg_loss": -1.5},
]
EVALUATION = {"eval/reward": 0.5, "eval/accuracy": 0.125}


@pytest.fixture
def offline_env(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)


def _run(names, out, resume_state=None, resume_step=None, records=RECORDS, evaluation=EVALUATION):
    trackers = tr.make_trackers(names, "proj", "exp", out, CONFIG, resume_state, resume_step)
    for record in records:
        trackers.log(record, record["step"])
    trackers.summary(evaluation, records[-1]["step"])
    state = trackers.state()
    trackers.close()
    return trackers, state


def _expected(records, evaluation):
    """{key: {step: value}}: what every tracker must hold."""
    want = {}
    for record in records:
        for key, value in tr.scalars(record).items():
            want.setdefault(key, {})[record["step"]] = value
    for key, value in evaluation.items():
        want.setdefault(key, {})[records[-1]["step"]] = value
    return want


def test_scalars_are_the_numbers_of_a_record_but_its_step():
    assert tr.scalars({"step": 3, "version": 2, "a/b": 0.5, "flag": True, "name": "x"}) == {"version": 2.0, "a/b": 0.5}
    assert tr.flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": None}) == {"a.b": 1, "a.c.d": [1, 2], "e": None}


def test_tensorboard_event_files_hold_every_scalar_at_its_step(tmp_path):
    _run(["console", "jsonl", "tensorboard"], tmp_path)
    got = tensorboard_scalars(tmp_path / "tensorboard")
    want = _expected(RECORDS, EVALUATION)
    assert set(got) == set(want)
    for key, steps in want.items():  # event files store float32
        assert got[key] == {s: float(np.float32(v)) for s, v in steps.items()}, key


def test_tensorboard_resume_drops_the_steps_after_the_checkpoint(tmp_path):
    _run(["tensorboard"], tmp_path)  # steps 1, 2
    redo = [{"step": 2, "version": 2, "critic/score/mean": 0.0, "timing_s/step": 1.0, "actor/pg_loss": 0.0}]
    _run(["tensorboard"], tmp_path, resume_step=1, records=redo, evaluation={})
    got = tensorboard_scalars(tmp_path / "tensorboard")
    assert got["critic/score/mean"] == {1: 0.25, 2: 0.0}  # step 2 of the interrupted run is gone


def test_wandb_offline_run_holds_metrics_config_and_summary_and_resume_keeps_its_id(tmp_path, offline_env):
    _, state = _run(["wandb"], tmp_path)
    (first,) = (tmp_path / "wandb").glob("offline-run-*")
    run = wandb_offline_run(first)
    assert run["run_id"] == state["wandb"]["run_id"] and run["project"] == "proj"
    want = _expected(RECORDS, EVALUATION)
    got = {key: {s: row[key] for s, row in run["history"].items() if key in row} for key in want}
    assert got == want
    assert {k: run["summary"][k] for k in EVALUATION} == EVALUATION
    assert json.loads(run["config"]["trainer"])["seed"] == 3

    later = [{"step": 3, "version": 3, "critic/score/mean": 1.0, "timing_s/step": 0.1}]
    _, resumed = _run(["wandb"], tmp_path, resume_state=state, resume_step=2, records=later, evaluation={})
    assert resumed["wandb"]["run_id"] == state["wandb"]["run_id"]
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2
    second = wandb_offline_run(next(r for r in runs if r != first))
    assert second["run_id"] == state["wandb"]["run_id"]
    assert second["history"][3]["critic/score/mean"] == 1.0


def test_mlflow_file_store_holds_metrics_and_params_and_resume_continues_the_run(tmp_path, offline_env):
    _, state = _run(["mlflow"], tmp_path)
    run_id = state["mlflow"]["run_id"]
    run = mlflow_run(tmp_path / "mlruns", run_id)
    assert run["metrics"] == _expected(RECORDS, EVALUATION)
    assert run["params"]["trainer.seed"] == "3" and run["params"]["actor.lr"] == "0.001"
    assert run["status"] == "FINISHED"

    later = [{"step": 3, "version": 3, "critic/score/mean": 1.0, "timing_s/step": 0.1}]
    _, resumed = _run(["mlflow"], tmp_path, resume_state=state, resume_step=2, records=later, evaluation={})
    assert resumed["mlflow"]["run_id"] == run_id
    assert mlflow_run(tmp_path / "mlruns", run_id)["metrics"]["critic/score/mean"] == {1: 0.25, 2: 0.75, 3: 1.0}


def test_mlflow_tracking_uri_is_honoured(tmp_path, offline_env, monkeypatch):
    store = tmp_path / "elsewhere"
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    _, state = _run(["mlflow"], tmp_path / "out")
    assert not (tmp_path / "out" / "mlruns").exists()
    assert mlflow_run(store, state["mlflow"]["run_id"])["metrics"]["critic/score/mean"] == {1: 0.25, 2: 0.75}


class _Broken:
    name = "broken"

    def __init__(self):
        self.calls = 0

    def log(self, values, step):
        self.calls += 1
        raise OSError(28, "No space left on device")

    def summary(self, values, step):
        raise AssertionError("a dropped tracker is never called again")

    def state(self):
        return {"run_id": "new"}

    def close(self):
        pass


class _Good:
    name = "good"

    def __init__(self):
        self.logged = []

    def log(self, values, step):
        self.logged.append((step, values))

    def summary(self, values, step):
        self.logged.append(("summary", values))

    def state(self):
        return {"run_id": "g"}

    def close(self):
        self.closed = True


def test_a_failing_tracker_warns_once_and_the_others_go_on(caplog):
    broken, good = _Broken(), _Good()
    trackers = tr.Trackers([broken, good], saved_state={"broken": {"run_id": "old"}})
    with caplog.at_level(logging.WARNING, logger="dppo.trackers"):
        for record in RECORDS:
            trackers.log(record, record["step"])
        trackers.summary(EVALUATION, 2)
    assert broken.calls == 1
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "tracker broken failed" in lines[0] and "No space left" in lines[0]
    assert [s for s, _ in good.logged] == [1, 2, 2, "summary"]
    # the failed tracker's run id is still the one a resumed run continues
    assert trackers.state() == {"broken": {"run_id": "old"}, "good": {"run_id": "g"}}
    trackers.close()
    assert good.closed


def test_a_tracker_that_cannot_start_warns_and_the_run_goes_on(tmp_path, offline_env, monkeypatch, caplog):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://x")
    with caplog.at_level(logging.WARNING, logger="dppo.trackers"):
        trackers = tr.make_trackers(["mlflow", "tensorboard"], "p", "e", tmp_path, CONFIG)
    assert trackers.names == ["tensorboard"]
    assert "tracker mlflow could not start" in caplog.records[0].getMessage()
    trackers.close()


def test_a_tracker_not_installed_is_one_line_naming_the_extra(monkeypatch):
    real = tr.importlib.util.find_spec
    monkeypatch.setattr(tr.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    tr.check_installed(["console", "tensorboard", "mlflow"])
    with pytest.raises(tr.TrackerMissingError, match=r"'wandb'.*pip install 'dppo\[trackers\]'") as err:
        tr.check_installed(["console", "wandb"])
    assert isinstance(err.value, ConfigError) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="unknown logger 'tensorbord'"):
        tr.check_installed(["tensorbord"])


def test_nan_values_pass_through(tmp_path):
    _run(["tensorboard"], tmp_path, records=[{"step": 1, "a": math.nan}], evaluation={})
    assert math.isnan(tensorboard_scalars(tmp_path / "tensorboard")["a"][1])


def test_dppo_train_with_a_tracker_not_installed_stops_before_anything_starts(tmp_path, monkeypatch, capsys):
    from dppo.cli import main

    real = tr.importlib.util.find_spec
    monkeypatch.setattr(tr.importlib.util, "find_spec", lambda name: None if name == "mlflow" else real(name))
    out = tmp_path / "run"
    assert main(["train", f"trainer.output_dir={out}", "trainer.logger=[console,mlflow]", "ray.enabled=true"]) == 2
    assert capsys.readouterr().err.strip() == (
        "dppo: error: trainer.logger names 'mlflow', but the mlflow package is "
        "not installed; install the trackers extra: pip install 'dppo[trackers]'"
    )
    assert not out.exists()  # nothing started: not even the output directory
