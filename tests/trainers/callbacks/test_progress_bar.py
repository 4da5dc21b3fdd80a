"""The tqdm bar is drawn only on a terminal: in a file (a SLURM log) its ``\\r`` frames are noise, and
the log lines carry the same information (update/total, loss, speed, time left)."""
from __future__ import annotations

import sys

import pytest

from mmvl_cli.run import main
from tests.fixtures.toy import register, toy_opts

register()


@pytest.mark.parametrize("tty, wanted, drawn", [(False, "true", False), (True, "true", True),
                                                 (True, "false", False)])
def test_bar_only_on_a_terminal(tmp_path, capsys, monkeypatch, tty, wanted, drawn):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    assert main(toy_opts(tmp_path, f"training.progress_bar={wanted}", "training.max_updates=8")) == 0
    out, err = capsys.readouterr()
    assert ("\r" in err and "upd" in err) is drawn, err[-500:]
    lines = [line for line in (out + err).splitlines() if "| update 8/8 |" in line]
    assert len(lines) == 1 and "loss" in lines[0] and "samples/s" in lines[0] and "eta 0:00:00" in lines[0]
