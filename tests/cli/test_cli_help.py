"""`--help` teaches: usage, the key=value grammar, model=/datasets=/run_type=, --list, --debug and
three examples that really parse; `mmvl_features` without arguments fails."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from mmvl.config import load_config
from mmvl_cli import plot, predict, run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _examples(text: str, program: str) -> list[list[str]]:
    """The example commands of a help text (continuation lines joined), without the program name."""
    body = text.split("Examples:", 1)[1].replace("\\\n", " ")
    return [shlex.split(line)[1:] for line in body.splitlines() if line.strip().startswith(program + " ")]


@pytest.mark.parametrize("module, program, preset", [
    (run, "mmvl_run", []),
    (predict, "mmvl_predict", ["run_type=test", "evaluation.predict=true"]),
])
def test_help_teaches_and_its_examples_parse(module, program, preset, capsys, monkeypatch):
    assert module.main(["--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: {program} ")
    for needle in ("key=value", "config=FILE", "model=NAME", "datasets=A[,B]", "run_type=TYPE",
                   "a.b.c=VALUE", "--list", "--debug", "MMVL_DEBUG=1", "exit code 2"):
        assert needle in text, needle
    examples = _examples(text, program)
    assert len(examples) == 3
    monkeypatch.chdir(ROOT)
    for args in examples:  # every example is a valid command line (paths, keys, values)
        config = load_config([*preset, *args])
        assert config.model and config.datasets
    assert module.main(["-h"]) == 0


def test_list_named_in_run_help_works(capsys):
    assert run.main(["--list", "dataset"]) == 0
    assert capsys.readouterr().out.startswith("dataset: ")


def test_plot_help(capsys):
    assert plot.main(["--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: mmvl_plot SAVE_DIR") and "--metric" in text and "--out" in text


@pytest.mark.proc
def test_features_without_arguments_fails():
    proc = subprocess.run([sys.executable, "-m", "mmvl_cli.features"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode != 0
    assert "usage: mmvl_features" in proc.stderr and "{convert,extract,info}" in proc.stderr
