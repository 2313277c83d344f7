"""Read back what the trackers wrote: TensorBoard event files, a W&B offline run's .wandb file, an MLflow file store.
Shared by the trackers' unit tests and the integration test of a run with trackers."""

from __future__ import annotations

import struct
from pathlib import Path

WANDB_HEADER_BYTES = 7  # ":W&B", magic 0xBEE1, version
WANDB_BLOCK_BYTES = 32768  # LevelDB's log format: records in 32 KiB blocks, split across blocks when needed
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of every scalar in the event files under log_dir."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def _wandb_records(path: Path) -> list[bytes]:
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B datastore file"
    records, pending, pos = [], b"", WANDB_HEADER_BYTES
    while pos + 7 <= len(data):
        left_in_block = WANDB_BLOCK_BYTES - pos % WANDB_BLOCK_BYTES
        if left_in_block < 7:  # the block's tail is padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == FULL:
            records.append(payload)
        elif kind == FIRST:
            pending = payload
        elif kind == MIDDLE:
            pending += payload
        elif kind == LAST:
            records.append(pending + payload)
        else:  # zero padding at the end of a file still being written
            break
    return records


def wandb_offline_run(run_dir: Path, timeout_s: float = 30.0) -> dict:
    """{"run_id", "project", "config" (key -> JSON text), "history" ({step: {key: value}}), "summary"} of one
    offline run directory (wandb/offline-run-*). wandb-core writes the file in its own process, after run.finish()
    has returned: read it once its exit record is there."""
    import json
    import time

    from wandb.proto import wandb_internal_pb2

    (path,) = Path(run_dir).glob("run-*.wandb")
    deadline = time.monotonic() + timeout_s
    while True:
        records = []
        for raw in _wandb_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            records.append(record)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    out = {"run_id": None, "project": None, "config": {}, "history": {}, "summary": {}}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["run_id"], out["project"] = record.run.run_id, record.run.project
            out["config"].update({item.key: item.value_json for item in record.run.config.update})
        elif kind == "config":
            out["config"].update({item.key: item.value_json for item in record.config.update})
        elif kind == "history":
            row = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in record.history.item}
            out["history"].setdefault(int(row.pop("_step")), {}).update(
                {k: v for k, v in row.items() if not k.startswith("_")}
            )
        elif kind == "summary":
            out["summary"].update(
                {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in record.summary.update}
            )
    return out


def mlflow_run(tracking_dir: Path, run_id: str) -> dict:
    """{"metrics": {key: {step: value}}, "params": {key: value}, "status"} of a run in an MLflow file store."""
    import os

    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=Path(tracking_dir).resolve().as_uri())
    run = client.get_run(run_id)
    metrics = {key: {m.step: m.value for m in client.get_metric_history(run_id, key)} for key in run.data.metrics}
    return {"metrics": metrics, "params": dict(run.data.params), "status": run.info.status}
