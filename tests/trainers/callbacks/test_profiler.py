"""``training.profiler``: a trace of the chosen window in <save_dir>/profiler/ and one top-10 table."""
from __future__ import annotations

import json

import pytest

from mmvl.config import load_config
from mmvl.errors import UserError
from mmvl.trainers import Trainer
from tests.fixtures.toy import register, toy_opts

register()


def test_profiler_writes_a_trace_of_the_window_and_logs_the_table_once(tmp_path):
    opts = toy_opts(tmp_path, "training.profiler.enabled=true", "training.profiler.wait=2",
                    "training.profiler.warmup=1", "training.profiler.active=3")
    Trainer(load_config(opts)).fit()
    traces = sorted((tmp_path / "save" / "profiler").iterdir())
    assert [p.name for p in traces] == ["rank0.6.pt.trace.json"]  # updates 4-6 recorded, written after 6
    trace = json.loads(traces[0].read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(n.startswith("aten::addmm") or n.startswith("aten::linear") for n in names), sorted(names)[:20]
    steps = sorted(e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#"))
    assert steps == ["ProfilerStep#3", "ProfilerStep#4", "ProfilerStep#5"]
    log = (tmp_path / "save" / "train.log").read_text()
    assert log.count("top 10 operators") == 1 and "Profiled updates 4-6" in log and "Self CPU" in log


def test_profiler_off_by_default_and_bad_window(tmp_path):
    Trainer(load_config(toy_opts(tmp_path / "off", "training.max_updates=2"))).fit()
    assert not (tmp_path / "off" / "save" / "profiler").exists()
    with pytest.raises(UserError, match="active"):
        Trainer(load_config(toy_opts(tmp_path / "bad", "training.profiler.enabled=true",
                                     "training.profiler.active=0")))
