"""TensorBoard events read back with tensorboard's own reader and checked against metrics.jsonl."""
from __future__ import annotations

import importlib.util
import json
import logging

import pytest
from omegaconf import OmegaConf

from mmvl.config import load_config
from mmvl.errors import UserError
from mmvl.trainers import run
from mmvl.trainers.callbacks import tensorboard as tb_module
from mmvl.trainers.callbacks.tensorboard import tensorboard_enabled
from tests.fixtures.toy import register, toy_opts

register()
pytest.importorskip("tensorboard")


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("tb")
    run(load_config(toy_opts(root, "training.tensorboard=true", "training.clip_grad_norm=0.5",
                             "training.curves=false")))
    return root / "save"


def _accumulator(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_scalars_match_metrics_jsonl(toy_run):
    acc = _accumulator(toy_run / "tensorboard")
    events = [json.loads(line) for line in open(toy_run / "metrics.jsonl")]
    expected: dict[str, dict[int, float]] = {}
    for e in events:
        prefix = "train" if e["split"] == "train" else f"{e['split']}/{e['dataset']}"
        for k, v in e.items():
            if k not in ("update", "epoch", "split", "dataset", "wall_s"):
                expected.setdefault(f"{prefix}/{k}", {})[e["update"]] = v
    tags = set(acc.Tags()["scalars"])
    assert tags == set(expected)
    assert {"train/total_loss", "train/cross_entropy", "train/lr", "train/grad_norm", "train/samples_per_s",
            "val/toy/accuracy", "val/toy/accuracy/even", "val/toy/total_loss"} <= tags
    for tag, by_update in expected.items():
        got = {s.step: s.value for s in acc.Scalars(tag)}
        assert got == pytest.approx(by_update, rel=1e-6), tag
    assert sorted(expected["train/total_loss"]) == [4, 8, 12]
    assert sorted(expected["val/toy/accuracy"]) == [6, 12]


def test_config_text_and_hparams_with_final_metrics(toy_run):
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = _accumulator(toy_run / "tensorboard")
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "    batch_size: 8" in text and "model: toy_mlp" in text
    content = acc.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hparams = start.session_start_info.hparams
    assert hparams["optimizer.params.lr"].number_value == pytest.approx(0.01)
    assert hparams["model"].string_value == "toy_mlp"
    assert hparams["datasets"].string_value == '["toy"]'
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    metric_tags = {m.name.tag for m in experiment.metric_infos}
    val = [json.loads(line) for line in open(toy_run / "metrics.jsonl") if '"val"' in line][-1]
    assert metric_tags == {"train/total_loss"} | {f"val/toy/{k}" for k in val
                                                 if k not in ("update", "epoch", "split", "dataset", "wall_s")}


def test_off_writes_nothing(tmp_path):
    run(load_config(toy_opts(tmp_path, "training.tensorboard=false", "training.max_updates=4",
                             "training.curves=false")))
    assert not (tmp_path / "save" / "tensorboard").exists()


def _without_tensorboard(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(tb_module.importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))


def test_true_without_package_is_a_user_error(monkeypatch):
    _without_tensorboard(monkeypatch)
    with pytest.raises(UserError, match="training.tensorboard=true.*pip install tensorboard"):
        tensorboard_enabled(OmegaConf.create({"training": {"tensorboard": True}}))


def test_auto_follows_the_package(monkeypatch, caplog):
    auto = OmegaConf.create({"training": {"tensorboard": "auto"}})
    assert tensorboard_enabled(auto) is True
    assert tensorboard_enabled(OmegaConf.create({"training": {"tensorboard": False}})) is False
    _without_tensorboard(monkeypatch)
    logger = logging.getLogger("mmvl")
    monkeypatch.setattr(logger, "propagate", True)
    with caplog.at_level(logging.INFO, logger="mmvl"):
        assert tensorboard_enabled(auto) is False
    assert "not installed" in caplog.text


def test_default_is_auto():
    assert load_config(["model=toy_mlp", "datasets=toy"]).training.tensorboard == "auto"


def test_a_resumed_run_replaces_the_abandoned_steps(tmp_path):
    """Crash after the log at update 8, resume from the checkpoint at 6: TensorBoard keeps one value per
    step (the resumed run purges what the first one logged past 6), as mmvl.runs does for metrics.jsonl."""
    from mmvl.runs import Run

    opts = ("training.tensorboard=true", "training.curves=false", "training.checkpoint_interval=6")
    run(load_config(toy_opts(tmp_path, *opts, "training.max_updates=8")))
    ckpts = tmp_path / "save" / "checkpoints"
    for name in ("last.ckpt", "best.ckpt", "model_8.ckpt"):
        (ckpts / name).unlink(missing_ok=True)
    run(load_config(toy_opts(tmp_path, *opts, f"checkpoint.resume_file={ckpts / 'model_6.ckpt'}")))
    acc = _accumulator(tmp_path / "save" / "tensorboard")
    steps = {s.step: s.value for s in acc.Scalars("train/total_loss")}
    assert sorted(steps) == [4, 8, 12] and len(acc.Scalars("train/total_loss")) == 3
    kept = {e["update"]: e["total_loss"] for e in Run(tmp_path / "save").train}
    assert steps == pytest.approx(kept, rel=1e-6)
    events = [json.loads(line) for line in open(tmp_path / "save" / "metrics.jsonl")]
    assert [e["update"] for e in events if e["split"] == "train"] == [4, 8, 8, 12]  # 8 was logged twice
