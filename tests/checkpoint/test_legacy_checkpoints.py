"""Checkpoints written by mmvl before the checkpoint package (``tests/fixtures/legacy``, made at
40c2419 by ``make.py`` there) still resume: a full ``last.ckpt`` continues bitwise where an
uninterrupted run of today's code goes, and a sharded folder of 2 fsdp ranks resumes at one
process, re-sharded, into the same weights as that run's full export of the same update."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from mmvl.checkpoint import CheckpointManager, load_checkpoint, schema
from mmvl.config import load_config
from mmvl.trainers import Trainer
from tests.fixtures.toy import register, toy_opts

LEGACY = Path(__file__).resolve().parent.parent / "fixtures" / "legacy"


def _trainer(root: Path, *extra: str) -> Trainer:
    register()
    return Trainer(load_config(toy_opts(root, "training.evaluation_interval=0", *extra)))


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _plant(root: Path, *names: str, source: Path) -> CheckpointManager:
    manager = CheckpointManager(root / "save")
    manager.directory.mkdir(parents=True)
    for name in names:
        src = source / name
        (shutil.copytree if src.is_dir() else shutil.copyfile)(src, manager.directory / name)
    return manager


def test_the_legacy_files_are_the_old_layout():
    state = torch.load(LEGACY / "full" / "last.ckpt", weights_only=True)
    assert schema.FORMAT not in state  # written before the format key: version 1
    assert load_checkpoint(LEGACY / "full" / "last.ckpt")[schema.FORMAT] == 1
    assert set(state) == set(schema.KEYS) - {schema.SCALER}
    assert (LEGACY / "sharded" / "sharded_6" / "COMPLETE.json").is_file()


def test_a_legacy_full_checkpoint_resumes_bitwise(tmp_path):
    # the legacy run's AdamW was unfused (the CPU default then); bitwise needs the same kernel throughout
    unfused = "optimizer.params.fused=false"
    whole = _trainer(tmp_path / "whole", "checkpoint.resume=false", unfused)
    whole.fit()
    _plant(tmp_path / "resumed", "last.ckpt", source=LEGACY / "full")
    resumed = _trainer(tmp_path / "resumed", "checkpoint.resume=true", unfused)
    assert resumed.update == 6 and resumed.resumed_from.endswith("last.ckpt")
    resumed.fit()
    assert resumed.update == whole.update == 12
    for key, value in _weights(whole).items():
        assert torch.equal(value, _weights(resumed)[key]), key
    written = load_checkpoint(Path(tmp_path / "resumed" / "save" / "checkpoints" / "last.ckpt"))
    assert written[schema.FORMAT] == schema.FORMAT_VERSION and schema.update_of(written) == 12


def test_a_legacy_sharded_checkpoint_resumes_at_one_process(tmp_path):
    _plant(tmp_path / "sharded", "sharded_6", source=LEGACY / "sharded")
    from_parts = _trainer(tmp_path / "sharded", "checkpoint.resume=true")
    assert from_parts.update == 6 and from_parts.resumed_from.endswith("sharded_6")
    export = load_checkpoint(LEGACY / "sharded" / "last.ckpt")
    assert schema.update_of(export) == 6
    for key, value in export[schema.MODEL].items():
        assert torch.equal(value, _weights(from_parts)[key]), key
    _plant(tmp_path / "full", "last.ckpt", source=LEGACY / "sharded")
    from_export = _trainer(tmp_path / "full", "checkpoint.resume=true")
    from_parts.fit()
    from_export.fit()
    for key, value in _weights(from_export).items():
        assert torch.equal(value, _weights(from_parts)[key]), key
