"""Experiment trackers (verl's trainer.logger): the scalars of metrics.jsonl, at the same global steps, in
TensorBoard, Weights & Biases or MLflow too.

    trackers = make_trackers(names, project, experiment, output_dir, config, resume_state, resume_step)
    trackers.log(record, step)        every global step: every number of its metrics.jsonl line but "step"
    trackers.summary(evaluation)      the final evaluation (W&B run summary; the others log it at the last step)
    trackers.state()                  what a resumed run needs to continue the same runs (kept in the checkpoint)
    trackers.close()

console and jsonl are always on (the progress bar and summary table; metrics.jsonl); naming them is allowed.
tensorboard: event files under <output_dir>/tensorboard/. wandb: wandb.init(project, name, dir=output_dir),
so WANDB_MODE=offline and W&B's other variables apply; a resumed run passes the checkpoint's run id
(resume="allow"). mlflow: MLFLOW_TRACKING_URI, or a file store under <output_dir>/mlruns when unset; a resumed
run logs into the checkpoint's run again. The packages are the optional extra dppo[trackers];
check_installed() says which one is missing before anything starts. A tracker that raises mid-run (network
down, disk full) is reported in one warning line and logs nothing more; the run goes on.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from dppo.config import ConfigError
from dppo.config.choices import LOGGERS

log = logging.getLogger("dppo.trackers")

ALWAYS_ON = ("console", "jsonl")
# tracker name -> the module it needs (the package of the optional extra dppo[trackers])
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
assert set(LOGGERS) == set(ALWAYS_ON) | set(PACKAGES), "every trainer.logger name is a tracker here"
EXTRA = "pip install 'dppo[trackers]'"


class TrackerMissingError(ConfigError):
    """trainer.logger names a tracker whose package is not installed."""


def check_names(names: Iterable[str]) -> None:
    """ConfigError naming the first unknown tracker name."""
    for name in names:
        if name not in LOGGERS:
            raise ConfigError(f"trainer.logger: unknown logger {name!r}; expected some of {', '.join(LOGGERS)}")


def check_installed(names: Iterable[str]) -> None:
    """TrackerMissingError (a ConfigError) naming the first tracker whose package cannot be imported."""
    check_names(names)
    for name in names:
        module = PACKAGES.get(name)
        if module is not None and importlib.util.find_spec(module) is None:
            raise TrackerMissingError(
                f"trainer.logger names {name!r}, but the {module} package is not installed; "
                f"install the trackers extra: {EXTRA}"
            )


def scalars(record: Mapping[str, object]) -> dict[str, float]:
    """The numbers of a metrics.jsonl record but its step (the x axis), as floats."""
    return {
        key: float(value)
        for key, value in record.items()
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def flatten(config: Mapping, prefix: str = "") -> dict[str, object]:
    """{"a": {"b": 1}} -> {"a.b": 1}: a nested config as dotted keys (MLflow's parameters, TensorBoard's text)."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


# ---- the trackers ------------------------------------------------------------------------------------


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, output_dir: Path, config: Mapping, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a resumed run drops the events an interrupted run logged after its checkpoint
        purge = None if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(log_dir=str(output_dir / "tensorboard"), purge_step=purge)
        if resume_step is None:
            lines = "\n".join(f"    {key}: {value}" for key, value in flatten(config).items())
            self.writer.add_text("config", lines, 0)

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # what a killed run logged is on disk

    def summary(self, values: dict[str, float], step: int) -> None:
        pass  # logged at the last step already

    def state(self) -> dict:
        return {}

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    name = "wandb"

    def __init__(self, project: str, experiment: str, output_dir: Path, config: Mapping, run_id: str | None):
        import wandb

        self.run = wandb.init(
            project=project,
            name=experiment,
            dir=str(output_dir),
            config=dict(config),
            id=run_id,
            resume="allow" if run_id else None,
            settings=wandb.Settings(quiet=True),
        )

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def summary(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.run.summary[key] = value

    def state(self) -> dict:
        return {"run_id": self.run.id}

    def close(self) -> None:
        self.run.finish()


# MLflow accepts these characters in metric and parameter names; others become "_"
_MLFLOW_NAME = re.compile(r"[^0-9A-Za-z_\-. /:]")


class MlflowTracker:
    name = "mlflow"
    PARAMS_PER_BATCH = 100  # MLflow's limits per log_batch call
    METRICS_PER_BATCH = 1000
    PARAM_CHARS = 6000

    def __init__(self, project: str, experiment: str, output_dir: Path, config: Mapping, run_id: str | None):
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (output_dir / "mlruns").resolve().as_uri()
            # MLflow 3 keeps its file store only on request; the file store is what this default promises
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        self.tracking_uri = uri
        if run_id is not None:
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            return
        found = self.client.get_experiment_by_name(project)
        experiment_id = found.experiment_id if found is not None else self.client.create_experiment(project)
        self.run_id = self.client.create_run(experiment_id, run_name=experiment).info.run_id
        self._log_params(flatten(config))

    def _log_params(self, params: dict[str, object]) -> None:
        from mlflow.entities import Param

        items = [Param(_MLFLOW_NAME.sub("_", key), str(value)[: self.PARAM_CHARS]) for key, value in params.items()]
        for start in range(0, len(items), self.PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[start : start + self.PARAMS_PER_BATCH])

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        items = [Metric(_MLFLOW_NAME.sub("_", key), value, now_ms, step) for key, value in values.items()]
        for start in range(0, len(items), self.METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=items[start : start + self.METRICS_PER_BATCH])

    def summary(self, values: dict[str, float], step: int) -> None:
        pass  # logged at the last step already; MLflow has no separate summary

    def state(self) -> dict:
        return {"run_id": self.run_id}

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


# ---- the set a run logs to ---------------------------------------------------------------------------


class Trackers:
    """The trackers of one run. Each call goes to every tracker still working; one that raises is reported in one
    warning line and dropped, and the run goes on (metrics.jsonl holds everything anyway)."""

    def __init__(self, trackers: list, saved_state: Mapping[str, dict] | None = None):
        self.trackers = list(trackers)
        self.failed: dict[str, str] = {}
        # a tracker that failed keeps the state it had (a resumed run still continues its run)
        self._saved_state = {key: dict(value) for key, value in (saved_state or {}).items()}

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.trackers]

    def _each(self, what: str, call) -> None:
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as err:  # noqa: BLE001  a tracker must never stop the run
                self._drop(tracker, what, err)

    def _drop(self, tracker, what: str, err: BaseException) -> None:
        self.trackers.remove(tracker)
        reason = " ".join(f"{type(err).__name__}: {err}".split())[:300]
        self.failed[tracker.name] = reason
        log.warning(
            f"tracker {tracker.name} failed to {what} ({reason}); it logs nothing more in this run, "
            f"metrics.jsonl has everything"
        )
        try:
            tracker.close()
        except Exception as close_err:  # noqa: BLE001  it failed already; one warning line is enough
            log.debug(f"closing the failed tracker {tracker.name} raised {close_err!r}")

    def log(self, record: Mapping[str, object], step: int) -> None:
        values = scalars(record)
        self._each(f"log step {step}", lambda t: t.log(values, step))

    def summary(self, evaluation: Mapping[str, float], step: int) -> None:
        """The final evaluation: logged at the last step (it joins that step's line of metrics.jsonl) and, where
        the tracker has one, as the run's summary."""
        values = scalars(evaluation)
        if values:
            self._each(
                f"log the final evaluation at step {step}", lambda t: (t.log(values, step), t.summary(values, step))
            )

    def state(self) -> dict[str, dict]:
        """name -> what a resumed run needs to continue that tracker's run (plain types: kept in trainer.pt)."""
        state = dict(self._saved_state)
        for tracker in self.trackers:
            try:
                state[tracker.name] = tracker.state()
            except Exception as err:  # noqa: BLE001
                self._drop(tracker, "report its run id", err)
        return {key: value for key, value in state.items() if value}

    def close(self) -> None:
        self._each("close", lambda t: t.close())
        self.trackers = []


def make_trackers(
    names: Iterable[str],
    project: str,
    experiment: str,
    output_dir: str | os.PathLike,
    config: Mapping,
    resume_state: Mapping[str, dict] | None = None,
    resume_step: int | None = None,
) -> Trackers:
    """The trackers of names (console and jsonl are always on and need nothing here). config: the resolved config
    (nested dict), the run's parameters. resume_state: Trackers.state() of the checkpoint a resumed run continues
    (None: a fresh run); resume_step: that checkpoint's global step."""
    names = list(dict.fromkeys(names))
    check_installed(names)
    output_dir = Path(output_dir)
    saved = dict(resume_state or {})
    builders = {
        "tensorboard": lambda: TensorBoardTracker(output_dir, config, resume_step),
        "wandb": lambda: WandbTracker(project, experiment, output_dir, config, saved.get("wandb", {}).get("run_id")),
        "mlflow": lambda: MlflowTracker(project, experiment, output_dir, config, saved.get("mlflow", {}).get("run_id")),
    }  # fmt: skip
    made = []
    for name in names:
        if name not in builders:
            continue  # console, jsonl: always on
        try:
            made.append(builders[name]())
        except Exception as err:  # noqa: BLE001  as mid-run: one warning line, and the run goes on
            reason = " ".join(f"{type(err).__name__}: {err}".split())[:300]
            log.warning(
                f"tracker {name} could not start ({reason}); the run goes on without it, metrics.jsonl has everything"
            )
    return Trackers(made, saved)
