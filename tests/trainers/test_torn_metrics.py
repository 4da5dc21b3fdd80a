"""A run killed while writing metrics.jsonl leaves half a line; the next run into that folder cuts it
(with a warning) instead of appending its first event onto it."""
from __future__ import annotations

import json

from mmvl.config import load_config
from mmvl.runs import Run
from mmvl.trainers.trainer import run
from tests.fixtures.toy import register, toy_opts


def test_a_resumed_run_cuts_the_torn_line(tmp_path, capfd):
    register()
    opts = toy_opts(tmp_path, "training.max_updates=4", "training.log_interval=2",
                    "training.evaluation_interval=0", "training.checkpoint_interval=2")
    run(load_config(opts))
    events = tmp_path / "save" / "metrics.jsonl"
    whole = events.read_bytes()
    events.write_bytes(whole + b'{"update": 6, "split": "tra')  # killed mid-write
    capfd.readouterr()
    run(load_config(opts + ["training.max_updates=6"]))
    assert "metrics.jsonl ended in an unfinished line (27 bytes" in capfd.readouterr().out
    lines = events.read_text().splitlines()
    assert [json.loads(line) for line in lines]  # every line is an event again
    assert events.read_bytes().startswith(whole)
    assert max(e["update"] for e in map(json.loads, lines)) == 6
    Run(tmp_path / "save")  # mmvl_plot's reader accepts the run
