"""A changed ``model_config.<model>.freeze`` on resume: refused like a changed lr, and taken on only
with ``checkpoint.reset.optimizer`` (the saved optimizer state belongs to the old set of trainable
parameters); an unchanged one resumes strictly."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from mmvl.config.schema import reset_needed
from mmvl.errors import UserError
from mmvl.io import safe_load
from mmvl.trainers.resume import check_resume_config
from mmvl_cli.run import main

TINY = Path(__file__).resolve().parents[1] / "models" / "tiny" / "relation_network.yaml"


def _config(tmp_path, freeze: list[str]):
    return OmegaConf.create({"env": {"save_dir": str(tmp_path)},
                             "model_config": {"relation_network": {"freeze": freeze}}})


def test_a_changed_freeze_needs_the_optimizer_reset(tmp_path):
    saved = {"config": OmegaConf.to_container(_config(tmp_path, ["image_encoder"]))}
    changed = _config(tmp_path, [])
    assert reset_needed("model_config.relation_network.freeze") == "optimizer"
    assert reset_needed("optimizer.params.lr") is None
    with pytest.raises(UserError, match=r"model_config.relation_network.freeze \(\['image_encoder'\] -> \[\]\)"):
        check_resume_config(saved, changed, "last.ckpt", [])
    with pytest.raises(UserError, match="resume with checkpoint.reset.optimizer=true"):
        check_resume_config(saved, changed, "last.ckpt", ["scheduler", "counts"])
    check_resume_config(saved, changed, "last.ckpt", ["optimizer"])  # taken on
    check_resume_config(saved, _config(tmp_path, ["image_encoder"]), "last.ckpt", [])  # unchanged


def test_a_checkpoint_from_before_freeze_existed_resumes_with_nothing_frozen(tmp_path):
    saved = {"config": {"env": {"save_dir": str(tmp_path)}, "model_config": {"relation_network": {}}}}
    check_resume_config(saved, _config(tmp_path, []), "old.ckpt", [])  # the shipped default: unchanged
    with pytest.raises(UserError, match=r"model_config.relation_network.freeze \(unset -> \['relation'\]\)"):
        check_resume_config(saved, _config(tmp_path, ["relation"]), "old.ckpt", [])


def _run(tmp_path, *extra: str) -> int:
    return main([f"config={TINY}", f"env.data_dir={tmp_path / 'data'}", f"env.save_dir={tmp_path / 'save'}",
                 "training.checkpoint_interval=2", "training.evaluation_interval=0", "run_type=train", *extra])


def _last(tmp_path) -> dict:
    return safe_load(tmp_path / "save" / "checkpoints" / "last.ckpt")


@pytest.mark.slow  # three short training runs through the CLI
def test_a_frozen_run_resumes_strictly_and_unfreezes_only_with_the_reset(tmp_path, capsys):
    frozen = "model_config.relation_network.freeze=[image_encoder]"
    assert _run(tmp_path, "training.max_updates=2", frozen) == 0
    first = _last(tmp_path)
    assert _run(tmp_path, "training.max_updates=4", frozen) == 0
    second = _last(tmp_path)
    assert second["trainer"]["update"] == 4
    encoder = [k for k in first["model"] if k.startswith("image_encoder.")]
    assert encoder and all(torch.equal(first["model"][k], second["model"][k]) for k in encoder)
    assert any(not torch.equal(first["model"][k], second["model"][k]) for k in first["model"] if k not in encoder)
    log = (tmp_path / "save" / "train.log").read_text()
    assert "parameters (frozen: image_encoder)" in log

    capsys.readouterr()
    assert _run(tmp_path, "training.max_updates=6", "checkpoint.reset.scheduler=true") == 2
    assert "checkpoint.reset.optimizer=true" in capsys.readouterr().err
    assert _run(tmp_path, "training.max_updates=6", "checkpoint.reset.optimizer=true") == 0
    third = _last(tmp_path)
    assert third["trainer"]["update"] == 6
    assert any(not torch.equal(second["model"][k], third["model"][k]) for k in encoder)  # it trains again
