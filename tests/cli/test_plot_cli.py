"""mmvl_plot on two tiny runs that differ in optimizer.params.lr: labels, table, figure, errors."""
from __future__ import annotations

import json

import pytest
from PIL import Image

from mmvl.config import load_config
from mmvl.trainers import run
from mmvl_cli.plot import main
from tests.fixtures.toy import register, toy_opts

register()


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("plot")
    for name, lr in (("slow", "0.01"), ("fast", "0.05")):
        run(load_config(toy_opts(root / name, f"optimizer.params.lr={lr}", "training.tensorboard=false",
                                 "training.curves=false")))
    return root / "slow" / "save", root / "fast" / "save"


def _val_events(save):
    return [json.loads(line) for line in open(save / "metrics.jsonl") if '"split": "val"' in line]


def test_labels_table_and_figure(two_runs, tmp_path, capsys):
    slow, fast = two_runs
    out = tmp_path / "compare.png"
    assert main([str(slow), str(fast), "--metric", "toy/accuracy", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert lines[0].split()[:2] == ["run", "metric"]
    for save, label in ((slow, "optimizer.params.lr=0.01"), (fast, "optimizer.params.lr=0.05")):
        row = next(line for line in lines if line.startswith(label))  # a run's first row carries its label
        val = _val_events(save)
        first_metric = [k for k in val[-1] if k not in ("update", "epoch", "split", "dataset", "wall_s")][0]
        assert row.split()[1] == f"toy/{first_metric}"
        assert row.split()[4] == f"{val[-1][first_metric]:.4f}"  # last value
        assert row.endswith(" s")  # wall time
        accuracy = [line for line in lines[lines.index(row):] if "toy/accuracy " in line + " "][0].split()
        best = max(e["accuracy"] for e in val)
        assert accuracy[1:3] == [f"{best:.4f}", str(next(e["update"] for e in val if e["accuracy"] == best))]
    assert "data_dir" not in printed and "save_dir" not in printed
    assert f"wrote {out} (val toy/accuracy)" in printed
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size[0] >= 600


def test_unknown_metric_is_one_line_and_exit_2(two_runs, tmp_path, capsys):
    assert main([str(p) for p in two_runs] + ["--metric", "toy/acuracy", "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mmvl: error: --metric='toy/acuracy'") and "Did you mean 'accuracy'" in err
    assert len(err.splitlines()) == 1


def test_not_a_save_dir(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl' does not exist" in err and str(tmp_path) in err
