"""Checkpoints written by mmvl before the checkpoint package (``tests/fixtures/legacy``, made at
40c2419 by ``make.py`` there) still resume: a full ``last.ckpt`` continues bitwise as the same content saved in today's layout
does (both computed here: the files hold inputs, never results to match), and a sharded folder of 2 fsdp ranks resumes at one
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


def _state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The model's weights and the optimizer's tensors: what a resumed run must reproduce."""
    out = {f"model.{k}": v for k, v in _weights(trainer).items()}
    for pid, s in trainer.optimizer.state_dict()["state"].items():
        out.update({f"optimizer.{pid}.{k}": v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)})
    return out


def test_a_legacy_full_checkpoint_resumes_bitwise(tmp_path):
    """The old file resumes and continues exactly as a file of today's layout with the same content.

    Both sides of the comparison run here, from the same update-6 state: the legacy file as it was
    written, and its content saved in today's layout. The file is an input, never a result: an
    uninterrupted run on this machine is *not* bitwise equal to the file's first 6 updates. Measured
    2026-12-04 on an AMD EPYC (AVX512): the update-6 weights differ from the fixture's by up to 3e-8
    (1-2 float32 ulps) in every ``Linear``, with fused or unfused AdamW; the same with torch 2.13.0
    and 2.14.1 (the same MKL 2024.2), and under ``ATEN_CPU_CAPABILITY=avx2`` and ``default`` (so not
    ATen's vectorised kernels), while ``MKL_CBWR=COMPATIBLE`` gives yet other last bits. The sums
    that differ are MKL's GEMMs, whose blocking and order MKL picks by CPU: the fixture's machine
    took a path this CPU does not. Bitwise resume is a guarantee per machine (the same CPU, build
    and threads); across machines runs agree to float tolerance.
    """
    legacy = LEGACY / "full" / "last.ckpt"
    _plant(tmp_path / "legacy", "last.ckpt", source=LEGACY / "full")
    CheckpointManager(tmp_path / "today" / "save").save(load_checkpoint(legacy), update=6)
    today = tmp_path / "today" / "save" / "checkpoints" / "last.ckpt"
    assert schema.FORMAT in torch.load(today, weights_only=True)  # written in today's layout
    runs = {}
    for name in ("legacy", "today"):
        trainer = _trainer(tmp_path / name, "checkpoint.resume=true")
        assert trainer.update == 6 and trainer.resumed_from.endswith("last.ckpt")
        trainer.fit()
        assert trainer.update == 12
        runs[name] = _state(trainer)
    assert runs["legacy"].keys() == runs["today"].keys()
    for key, value in runs["today"].items():
        assert torch.equal(value, runs["legacy"][key]), key
    written = load_checkpoint(Path(tmp_path / "legacy" / "save" / "checkpoints" / "last.ckpt"))
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
