"""What TensorBoard, W&B (offline) and MLflow hold after a run, read back with their own readers:
the Engine running the tracking port script (as Accelerate's by_feature/tracking.py) against
Accelerate itself, and the Trainer; at 1 and 2 processes (the Engine's under ``mmvl_launch``), where
only rank 0 writes. W&B and MLflow
take seconds to start, so every test here is slow."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmvl.config import load_config
from mmvl.tracking.mlflow import metric_key
from mmvl.trainers import Trainer, run
from tests.distributed.dist_launch import launch
from tests.engine.test_ports import PORTS, REFERENCE, ported
from tests.fixtures.faults import child_env, communicate, free_port
from tests.fixtures.toy import register, toy_opts
from tests.tracking.readers import mlflow_runs, tensorboard_scalars, wandb_config, wandb_history, wandb_runs

for package in ("tensorboard", "wandb", "mlflow"):
    pytest.importorskip(package)
pytestmark = pytest.mark.slow
register()
ALL = "[tensorboard, wandb, mlflow]"
#: the keys the port script logs every epoch
LOGGED = ("accuracy", "train_loss", "epoch")
#: mmvl against Accelerate (fp32 CPU, dataset order, the same arithmetic), and 2 processes against 1
TOLERANCE = 1e-5
NO_KEY = {"WANDB_API_KEY": None, "WANDB_MODE": None, "MLFLOW_TRACKING_URI": None}


def _script(script: Path, project: Path, *args: str, nproc: int = 1, **env: str | None) -> dict:
    """The port script run with ``--with_tracking`` into ``project``; its result.json and model."""
    command = [str(REFERENCE), str(script)] if script.parent == PORTS else [str(script)]
    # several processes: through mmvl_launch (as `accelerate launch` would start the original)
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "mmvl_cli.launch", "--num_processes",
                                                    str(nproc), "--main_process_port", str(free_port())]
    environ = {k: v for k, v in child_env(CUDA_VISIBLE_DEVICES="", WANDB_CONSOLE="off").items() if k not in env}
    environ.update({k: v for k, v in env.items() if v is not None})
    out = project.parent / f"{project.name}_out"
    popen = subprocess.Popen([*launcher, *command, "--cpu", "--no_shuffle", "--with_tracking", "--project_dir",
                              str(project), "--output_dir", str(out), *args], env=environ, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    result = communicate(popen, 300)
    assert result.returncode == 0, result.stderr[-3000:]
    return {**json.loads((out / "result.json").read_text()), "model": torch.load(out / "model.pt", weights_only=True)}


def _by_step(logged: list[dict], key: str) -> dict[int, float]:
    return {int(row["epoch"]): row[key] for row in logged}


def _one_run_each(project: Path, run_name: str) -> tuple[dict, dict, dict]:
    """The TensorBoard scalars, the one W&B run's history and the one MLflow run's metrics."""
    assert len(list((project / run_name).glob("events.out.tfevents.*"))) == 1
    runs = wandb_runs(project)
    assert len(runs) == 1, runs
    stored = mlflow_runs(project / "mlruns")
    assert len(stored) == 1, stored
    return tensorboard_scalars(project / run_name), wandb_history(runs[0]), next(iter(stored.values()))[1]


def _close(a: dict[int, float], b: dict[int, float]) -> None:
    assert a.keys() == b.keys() and all(abs(a[k] - b[k]) <= TOLERANCE for k in a), (a, b)


def test_the_engine_tracks_what_accelerate_tracks_and_two_processes_write_once(tmp_path):
    """Also ``mmvl_launch --num_processes 2`` running a port script: it ends where one process ends."""
    script = ported(PORTS / "tracking.py", tmp_path / "port")
    mine = _script(script, tmp_path / "mmvl", "--batch_size", "8", **NO_KEY)  # W&B offline by itself
    store = tmp_path / "acc" / "mlruns"
    # Accelerate's W&B run is left out (disabled): its TensorBoard and MLflow runs are compared
    _script(PORTS / "tracking.py", tmp_path / "acc", "--batch_size", "8", WANDB_MODE="disabled",
            MLFLOW_TRACKING_URI=f"file:{store}", MLFLOW_ALLOW_FILE_STORE="true")
    two = _script(script, tmp_path / "two", "--batch_size", "4", nproc=2, **NO_KEY)
    tb, wb, ml = _one_run_each(tmp_path / "mmvl", "tracking")
    acc_tb = tensorboard_scalars(tmp_path / "acc" / "tracking")
    acc_ml = next(iter(mlflow_runs(store).values()))[1]
    for key in LOGGED:
        expected = _by_step(mine["logged"], key)
        for got in (tb[key], wb[key], ml[key], acc_tb[key], acc_ml[key]):
            _close(got, expected)
    assert wandb_config(wandb_runs(tmp_path / "mmvl")[0])["lr"] == pytest.approx(0.01)
    for key, value in mine["model"].items():  # the same global batches: the same weights
        torch.testing.assert_close(two["model"][key], value, atol=TOLERANCE, rtol=0, msg=key)
    tb2, wb2, ml2 = _one_run_each(tmp_path / "two", "tracking")  # rank 1 wrote nothing of its own
    for got in (tb2["accuracy"], wb2["accuracy"], ml2["accuracy"]):
        _close(got, _by_step(mine["logged"], "accuracy"))


def _expected(save: Path) -> dict[str, dict[int, float]]:
    """metrics.jsonl as tracker keys: ``train/<field>`` and ``<split>/<dataset>/<metric>`` by update."""
    out: dict[str, dict[int, float]] = {}
    for line in (save / "metrics.jsonl").read_text().splitlines():
        event = json.loads(line)
        prefix = "train" if event["split"] == "train" else f"{event['split']}/{event['dataset']}"
        for key, value in event.items():
            if key not in ("update", "epoch", "split", "dataset", "wall_s"):
                out.setdefault(f"{prefix}/{key}", {})[event["update"]] = value
    return out


def _trainer_tracked_everything(save: Path) -> None:
    expected = _expected(save)
    assert {"train/total_loss", "val/toy/accuracy"} <= set(expected)
    runs = wandb_runs(save)
    stored = mlflow_runs(save / "mlruns")
    assert len(runs) == 1 and list(stored) == ["save"]  # one run, named after the save folder
    run_info, metrics = stored["save"]
    history = wandb_history(runs[0])
    tb = tensorboard_scalars(save / "tensorboard")
    for key, by_update in expected.items():
        for got in (history[key], metrics[metric_key(key, "file:")], tb[key]):
            assert got.keys() == by_update.keys() and all(
                got[u] == pytest.approx(v, rel=1e-6) for u, v in by_update.items()), key
    assert wandb_config(runs[0])["model"] == "toy_mlp" and run_info.data.params["training.batch_size"] == "8"
    assert run_info.info.status == "FINISHED"


def test_the_trainer_tracks_every_logged_number_in_every_tracker(tmp_path, monkeypatch):
    for key in NO_KEY:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    run(load_config(toy_opts(tmp_path, f"training.trackers={ALL}", "training.tensorboard=auto")))
    _trainer_tracked_everything(tmp_path / "save")


def _fit(env, root: str) -> None:
    register()
    torch.set_num_threads(1)
    short = ("training.max_updates=4", "training.log_interval=2", "training.evaluation_interval=4",
             "training.checkpoint_interval=4")
    Trainer(load_config(toy_opts(root, f"training.trackers={ALL}", "training.tensorboard=auto", *short)), env=env).fit()


def test_two_trainer_processes_track_once(tmp_path, monkeypatch):
    for key in NO_KEY:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    launch(_fit, world_size=2, args=(str(tmp_path),), timeout=240)
    _trainer_tracked_everything(tmp_path / "save")
    assert len(list((tmp_path / "save" / "tensorboard").glob("events.out.tfevents.*"))) == 1
