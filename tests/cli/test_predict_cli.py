"""``mmvl_predict`` predicts only with trained weights: ``checkpoint.resume_file`` or a checkpoint in
``env.save_dir``; without either it stops with one line (it used to predict with untrained weights)."""
from __future__ import annotations

import json

from mmvl_cli.predict import main as predict
from mmvl_cli.run import main
from tests.fixtures.toy import register, toy_opts

register()


def _error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("mmvl: error: ") and "Traceback" not in err, err
    return lines[0]


def test_no_checkpoint_is_an_error(tmp_path, capsys):
    assert predict(toy_opts(tmp_path)) == 2
    line = _error(capsys)
    assert "needs trained weights" in line and str(tmp_path / "save" / "checkpoints") in line
    assert "checkpoint.resume_file" in line
    assert not (tmp_path / "save" / "predictions").exists()


def test_checkpoint_found_in_save_dir(tmp_path, capsys):
    assert main(toy_opts(tmp_path, "training.max_updates=2")) == 0
    assert predict(toy_opts(tmp_path)) == 0
    rows = json.loads((tmp_path / "save" / "predictions" / "toy_test.json").read_text())
    assert len(rows) == 21
    capsys.readouterr()
    assert predict(toy_opts(tmp_path, "checkpoint.resume=false")) == 2  # told not to load it
    assert "checkpoint.resume=false" in _error(capsys)
