"""A checkpoint whose pickle would run code (a ``__reduce__`` that creates a marker file) is refused
with exit code 2 and a clear message, wherever it is met: ``checkpoint.resume_file``, a planted
``last.ckpt`` under ``checkpoint.resume=auto``, ``mmvl_predict``; the marker never appears."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from mmvl_cli.run import main
from tests.fixtures.toy import register, toy_opts

register()


class Payload:
    """Unpickling this calls ``open(marker, "w")``: a stand-in for arbitrary code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plant(path: Path, marker: Path) -> Path:
    """A file that looks like an mmvl checkpoint and runs code when fully unpickled."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": {"net.0.weight": torch.zeros(16, 8)}, "trainer": {"update": 3},
                "extra": Payload(marker)}, path)
    return path


def test_payload_really_runs_code_when_unpickled(tmp_path):
    """Guards the other tests: with weights_only=False the planted file does create its marker."""
    marker = tmp_path / "pwned"
    torch.load(plant(tmp_path / "evil.ckpt", marker), weights_only=False)
    assert marker.exists()


def _assert_refused(capsys, code: int, marker: Path, *needles: str) -> None:
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("mmvl: error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not marker.exists(), "the checkpoint's pickle ran code"


def test_resume_file(tmp_path, capsys):
    marker = tmp_path / "pwned"
    evil = plant(tmp_path / "downloads" / "model.ckpt", marker)
    code = main(toy_opts(tmp_path, f"checkpoint.resume_file={evil}"))
    _assert_refused(capsys, code, marker, str(evil), "pickled Python objects", ".open")
    assert not (tmp_path / "save" / "checkpoints").exists()


def test_planted_last_ckpt_with_resume_auto(tmp_path, capsys):
    marker = tmp_path / "pwned"
    last = plant(tmp_path / "save" / "checkpoints" / "last.ckpt", marker)
    before = last.read_bytes()
    code = main(toy_opts(tmp_path, "checkpoint.resume=auto"))
    _assert_refused(capsys, code, marker, "no loadable checkpoint", "last.ckpt", "pickled Python objects")
    assert last.read_bytes() == before  # refused, not replaced by a fresh run


def test_planted_last_ckpt_next_to_good_ones_is_skipped(tmp_path, capsys):
    """A good periodic checkpoint exists: resume=auto warns, skips the planted file, continues from it."""
    marker = tmp_path / "pwned"
    assert main(toy_opts(tmp_path, "training.max_updates=6", "training.checkpoint_interval=3")) == 0
    last = tmp_path / "save" / "checkpoints" / "last.ckpt"
    last.unlink()  # a hard link to model_6.ckpt: replace it, do not write through it
    plant(last, marker)
    assert main(toy_opts(tmp_path, "training.max_updates=8", "training.checkpoint_interval=3")) == 0
    log = (tmp_path / "save" / "train.log").read_text()
    assert "skipping unusable checkpoint" in log and "pickled Python objects" in log
    assert "model_6.ckpt at update 6" in log
    assert not marker.exists()


def test_predict_refuses_it(tmp_path, capsys):
    from mmvl_cli.predict import main as predict

    marker = tmp_path / "pwned"
    evil = plant(tmp_path / "evil.ckpt", marker)
    code = predict(toy_opts(tmp_path, f"checkpoint.resume_file={evil}"))
    _assert_refused(capsys, code, marker, str(evil), "pickled Python objects")


def test_pickled_feature_file_is_refused(tmp_path, capsys):
    """Region features as .npy: an object array (pickle inside) is refused unless allow_pickle."""
    from tests.fixtures.vl_data import write_hateful_memes
    from tests.reliability.test_bad_inputs import vl_opts

    marker = tmp_path / "pwned"
    write_hateful_memes(tmp_path / "data")
    feats = tmp_path / "data" / "feats"
    feats.mkdir()
    for k in range(18):
        np.save(feats / f"{1000 + k:05d}.npy", np.zeros((3, 6), dtype=np.float32))
    evil = np.empty(1, dtype=object)
    evil[0] = Payload(marker)
    for k in range(8):  # every training image: the first batch meets one
        np.save(feats / f"{1000 + k:05d}.npy", evil, allow_pickle=True)
    shutil.rmtree(tmp_path / "save", ignore_errors=True)
    code = main(vl_opts("hateful_memes", tmp_path, "model_config.concat_bert.feature_dim=6",
                        "dataset_config.hateful_memes.processors.features={type: features, params: "
                        "{path: feats, max_features: 4}}"))
    _assert_refused(capsys, code, marker, ".npy", "allow_pickle")
