"""The Trainer end to end on a toy task: accumulation, resume, logging, NaN stop, early stop."""
from __future__ import annotations

import json
import os

import pytest
import torch

from mmvl import registry
from mmvl.io import safe_load
from mmvl.config import load_config
from mmvl.trainers import NonFiniteLossError, Trainer, run
from mmvl.trainers.callbacks import Callback
from tests.fixtures.toy import register, toy_opts

register()


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.engine.unwrap_model(trainer.model).state_dict().items()}


def _fit(tmp_path, *opts: str) -> Trainer:
    trainer = Trainer(load_config(toy_opts(tmp_path, *opts)))
    trainer.fit()
    return trainer


def test_accumulation_equals_one_big_batch(tmp_path):
    big = _fit(tmp_path / "a", "training.batch_size=8", "training.clip_grad_norm=0.5")
    acc = _fit(tmp_path / "b", "training.batch_size=4", "training.gradient_accumulation=2",
               "training.clip_grad_norm=0.5")
    for k, v in _params(big).items():
        torch.testing.assert_close(v, _params(acc)[k], atol=1e-6, rtol=0)


def test_resume_equals_uninterrupted(tmp_path):
    opts = ("model_config.toy_mlp.hidden_dropout_prob=0.2",)
    straight = _fit(tmp_path / "straight", *opts)
    first = _fit(tmp_path / "resumed", *opts, "training.callbacks=[{type: stop_at, params: {update: 5}}]")
    assert first.update == 5
    second = _fit(tmp_path / "resumed", *opts, "checkpoint.resume=true")
    assert second.update == 12
    for k, v in _params(straight).items():
        assert torch.equal(v, _params(second)[k]), k


def test_outputs_metrics_logs_and_checkpoints(tmp_path):
    results = run(load_config(toy_opts(tmp_path)))
    save = tmp_path / "save"
    events = [json.loads(line) for line in open(save / "metrics.jsonl")]
    train = [e for e in events if e["split"] == "train"]
    val = [e for e in events if e["split"] == "val"]
    assert [e["update"] for e in train] == [4, 8, 12]
    assert [e["update"] for e in val] == [6, 12]
    for e in events:
        assert {"update", "epoch", "split"} <= set(e)
    assert {"accuracy", "accuracy/even", "accuracy/odd", "total_loss", "cross_entropy"} <= set(val[-1])
    assert {"lr", "samples_per_s", "s_per_update", "peak_mem_mb", "total_loss"} <= set(train[-1])
    assert results["val"]["toy"]["accuracy"] == val[-1]["accuracy"]
    assert (save / "train.log").read_text().count("update 12/12") == 1
    assert "batch_size: 8" in (save / "config.yaml").read_text()
    ckpts = save / "checkpoints"
    assert (ckpts / "last.ckpt").exists() and (ckpts / "best.ckpt").exists()
    state = safe_load(str(ckpts / "last.ckpt"))
    assert state["trainer"]["update"] == 12
    best = safe_load(str(ckpts / "best.ckpt"))["trainer"]  # kept by the evaluation, early stop is off
    assert best["best_update"] == best["update"] == state["trainer"]["best_update"]
    assert best["best_value"] == pytest.approx(max(e["accuracy"] for e in val))
    assert set(state) >= {"model", "optimizer", "scheduler", "trainer", "data", "rng", "config"}


def test_loss_decreases(tmp_path):
    run(load_config(toy_opts(tmp_path, "training.max_updates=40", "training.log_interval=10")))
    events = [json.loads(line) for line in open(tmp_path / "save" / "metrics.jsonl")]
    losses = [e["total_loss"] for e in events if e["split"] == "train"]
    assert losses[-1] < losses[0] * 0.8


def test_max_epochs_sets_updates(tmp_path):
    trainer = Trainer(load_config(toy_opts(tmp_path, "training.max_epochs=2")))
    assert trainer.max_updates == 16  # 64 samples / batch 8 = 8 updates per epoch


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    trainer = Trainer(load_config(toy_opts(tmp_path, "training.max_updates=20")))
    poisoned = {"done": False}

    class Poison(Callback):
        def on_update_end(self, info):
            if trainer.update == 8 and not poisoned["done"]:
                poisoned["done"] = True
                with torch.no_grad():
                    next(trainer.model.parameters()).fill_(float("nan"))

    trainer.callbacks.append(Poison(trainer))
    with pytest.raises(NonFiniteLossError, match="update 9"):
        trainer.fit()
    state = safe_load(str(tmp_path / "save" / "checkpoints" / "last.ckpt"))
    assert state["trainer"]["update"] == 6
    assert all(torch.isfinite(v).all() for v in state["model"].values())


def test_early_stop_stops_when_metric_stalls(tmp_path):
    trainer = _fit(tmp_path, "training.max_updates=60", "optimizer.params.lr=0.0",
                   "training.evaluation_interval=2", "training.early_stop.enabled=true",
                   "training.early_stop.criteria=toy/accuracy", "training.early_stop.minimize=false",
                   "training.early_stop.patience=4")
    assert trainer.update == 6


def test_val_only_run_loads_resume_file(tmp_path):
    _fit(tmp_path)
    ckpt = tmp_path / "save" / "checkpoints" / "last.ckpt"
    results = run(load_config(toy_opts(tmp_path, "run_type=val", f"checkpoint.resume_file={ckpt}",
                                       f"env.save_dir={tmp_path}/eval")))
    ref = [json.loads(line) for line in open(tmp_path / "save" / "metrics.jsonl")]
    assert results["val"]["toy"]["accuracy"] == pytest.approx(ref[-1]["accuracy"], abs=1e-6)
    assert os.path.exists(tmp_path / "eval" / "metrics.jsonl")


@pytest.mark.cuda
def test_resume_on_cuda_equals_uninterrupted(tmp_path):
    """On a GPU the defaults pin batches (pin_memory: auto), prefetch them on a side stream, keep the
    workers across epochs and fuse AdamW; a stop + resume still retraces the uninterrupted run."""
    from mmvl.data.sample import DevicePrefetcher

    opts = ("training.device=cuda", "model_config.toy_mlp.hidden_dropout_prob=0.2", "training.num_workers=2",
            "training.max_updates=20")  # 8 batches an epoch: the runs cross epochs
    straight = _fit(tmp_path / "straight", *opts)
    assert isinstance(straight.train_data, DevicePrefetcher)
    loader = straight.train_data.source.loader
    assert loader.pin_memory and loader.persistent_workers and straight.optimizer.defaults["fused"] is True
    first = _fit(tmp_path / "resumed", *opts, "training.callbacks=[{type: stop_at, params: {update: 11}}]")
    assert first.update == 11
    second = _fit(tmp_path / "resumed", *opts, "checkpoint.resume=true")
    assert second.update == 20
    for k, v in _params(straight).items():
        assert v.is_cuda
        torch.testing.assert_close(_params(second)[k], v, atol=1e-6, rtol=0, msg=k)
