"""Read back what each tracker wrote, with the tracker's own libraries: TensorBoard's
EventAccumulator, W&B's record protobuf (``wandb.proto``) over its offline ``.wandb`` log, and
MLflow's client on the file store."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

#: the W&B transaction log: a 7-byte file header, then records in 32 KiB blocks, each record
#: chunk with a 7-byte header (crc32, length, type: 1 whole, 2 first, 3 middle, 4 last)
_WANDB_FILE_HEADER, _BLOCK, _CHUNK_HEADER = 7, 32 * 1024, 7


def tensorboard_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` of the event files directly in ``folder``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: {s.step: s.value for s in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def wandb_runs(folder: Path) -> list[Path]:
    """The offline run folders W&B wrote under ``folder/wandb``."""
    return sorted((folder / "wandb").glob("offline-run-*"))


def wandb_records(run: Path) -> list[Any]:
    """The protobuf records of an offline run's ``run-<id>.wandb`` log, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = next(run.glob("run-*.wandb")).read_bytes()
    assert data[:4] == b":W&B", "not a W&B transaction log"
    records, chunks, pos = [], b"", _WANDB_FILE_HEADER
    while pos + _CHUNK_HEADER <= len(data):
        if _BLOCK - pos % _BLOCK < _CHUNK_HEADER:  # a block's tail too short for a header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + _CHUNK_HEADER])
        if kind == 0:
            break
        chunks += data[pos + _CHUNK_HEADER:pos + _CHUNK_HEADER + length]
        pos += _CHUNK_HEADER + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


def wandb_history(run: Path) -> dict[str, dict[int, Any]]:
    """``{key: {step: value}}`` of what ``run.log`` recorded (W&B's own ``_`` keys left out)."""
    out: dict[str, dict[int, Any]] = {}
    for record in wandb_records(run):
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for key, value in row.items():
                if not key.startswith("_"):
                    out.setdefault(key, {})[int(row["_step"])] = value
    return out


def wandb_config(run: Path) -> dict[str, Any]:
    """The run's config (the last value of each key), from its run and config records."""
    config: dict[str, Any] = {}
    for record in wandb_records(run):
        kind = record.WhichOneof("record_type")
        items = record.run.config.update if kind == "run" else record.config.update if kind == "config" else []
        for item in items:
            config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return config


def mlflow_runs(store: Path) -> dict[str, Any]:
    """``{run name: (run, {metric: {step: value}})}`` of every experiment in the file store."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"file:{store}")
    out: dict[str, Any] = {}
    for experiment in client.search_experiments():
        for run in client.search_runs([experiment.experiment_id]):
            metrics = {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
                       for key in run.data.metrics}
            out[run.info.run_name] = (run, metrics)
    return out
