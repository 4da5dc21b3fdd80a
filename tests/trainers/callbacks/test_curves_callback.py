"""curves.png: redrawn at each evaluation (not again when nothing changed), rank 0, never fatal."""
from __future__ import annotations

import pytest
from PIL import Image

import mmvl.plots
from mmvl.config import load_config
from mmvl.trainers import run
from tests.fixtures.toy import register, toy_opts

register()


def _opts(tmp_path, *extra):
    return toy_opts(tmp_path, "training.tensorboard=false", "training.curves=true", *extra)


def test_drawn_at_each_evaluation(tmp_path, monkeypatch):
    drawn = []
    real = mmvl.plots.draw_run

    def counting(run_, path):
        drawn.append(run_.train[-1]["update"])
        return real(run_, path)

    monkeypatch.setattr(mmvl.plots, "draw_run", counting)
    run(load_config(_opts(tmp_path)))
    # evaluations at 6 and 12; the end of training adds nothing new after the evaluation at 12
    assert drawn == [4, 12]
    with Image.open(tmp_path / "save" / "curves.png") as image:
        assert image.format == "PNG" and image.size[0] > 300


def test_off(tmp_path):
    run(load_config(_opts(tmp_path, "training.curves=false", "training.max_updates=6")))
    assert not (tmp_path / "save" / "curves.png").exists()


def test_a_failed_drawing_warns_and_training_goes_on(tmp_path, monkeypatch):
    def broken(run_, path):
        raise ValueError("no room on the canvas")

    monkeypatch.setattr(mmvl.plots, "draw_run", broken)
    results = run(load_config(_opts(tmp_path, "training.max_updates=6")))
    assert results["updates"] == 6
    log = (tmp_path / "save" / "train.log").read_text()
    assert "WARNING | curves.png was not updated: ValueError: no room on the canvas" in log


@pytest.mark.parametrize("value", ["true", "false"])
def test_key_is_read(tmp_path, value):
    from mmvl.trainers import Trainer
    from mmvl.trainers.callbacks import CurvesCallback

    trainer = Trainer(load_config(_opts(tmp_path, f"training.curves={value}")))
    assert any(isinstance(c, CurvesCallback) for c in trainer.callbacks) == (value == "true")
