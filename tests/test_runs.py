"""Reading runs back: resumed segments, labels from differing config keys, best/last table."""
from __future__ import annotations

import json

import pytest
import yaml

from mmvl.errors import UserError
from mmvl.runs import Run, differing_keys, format_table, read_events, resolve_metric, run_labels, streams


def write_run(path, events, config=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    if config is not None:
        (path / "config.yaml").write_text(yaml.safe_dump(config))
    return path


def _train(update, loss, **extra):
    return {"update": update, "epoch": 0, "split": "train", "cross_entropy": loss, "total_loss": loss,
            "lr": 0.1 / update, **extra}


def _val(update, acc, loss, **extra):
    return {"update": update, "epoch": 0, "split": "val", "dataset": "toy", "cross_entropy": loss,
            "total_loss": loss, "accuracy": acc, **extra}


CONFIG = {"model": "toy_mlp", "datasets": ["toy"], "optimizer": {"params": {"lr": 0.01}},
          "model_config": {"toy_mlp": {"losses": ["cross_entropy"]}},
          "training": {"early_stop": {"criteria": None, "minimize": None}}, "env": {"save_dir": "x"}}


def test_a_resumed_segment_replaces_the_abandoned_updates(tmp_path):
    # killed after update 6 (events to 6 written), resumed from the checkpoint at 4
    events = [_train(2, 1.0), _train(4, 0.8), _val(4, 0.5, 0.9), _train(6, 0.7),
              _train(6, 0.65), _train(8, 0.6), _val(8, 0.6, 0.8)]
    got = streams(events)
    assert [e["update"] for e in got["train"]] == [2, 4, 6, 8]
    assert got["train"][2]["total_loss"] == 0.65
    assert [e["update"] for e in got["val/toy"]] == [4, 8]


def test_unfinished_last_line_is_ignored_and_bad_lines_raise(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(_train(2, 1.0)) + "\n" + '{"update": 4, "spl')
    assert len(read_events(path)) == 1
    path.write_text('{"upd\n' + json.dumps(_train(2, 1.0)) + "\n")
    with pytest.raises(UserError, match="line 1 is not JSON"):
        read_events(path)
    with pytest.raises(UserError, match="mmvl save dir"):
        Run(tmp_path / "nothing")


def test_summary_best_and_last_with_loss_directions(tmp_path):
    run = Run(write_run(tmp_path / "r", [_train(2, 1.0, wall_s=1.5), _val(2, 0.5, 0.9, wall_s=2.0),
                                          _train(4, 0.8, wall_s=3.0), _val(4, 0.7, 0.7, wall_s=3.5),
                                          _val(6, 0.6, 0.75, wall_s=4.25)], CONFIG))
    rows = {r["metric"]: r for r in run.summary()}
    assert rows["toy/accuracy"] == {"metric": "toy/accuracy", "best": 0.7, "best_update": 4, "last": 0.6,
                                    "last_update": 6}
    # a configured loss is minimised although its name does not end in "loss"
    assert rows["toy/cross_entropy"]["best"] == 0.7 and rows["toy/total_loss"]["best_update"] == 4
    assert run.wall_s == 4.25
    assert run.loss_keys() == ["cross_entropy", "total_loss"]
    assert run.default_metric() == "toy/accuracy"  # not the first key (a loss)


def test_early_stop_direction_applies_to_its_criterion(tmp_path):
    config = {**CONFIG, "training": {"early_stop": {"criteria": "toy/accuracy", "minimize": True}}}
    run = Run(write_run(tmp_path / "r", [_val(2, 0.5, 0.9), _val(4, 0.7, 0.7)], config))
    assert {r["metric"]: r["best"] for r in run.summary()}["toy/accuracy"] == 0.5


def test_labels_name_the_differing_keys(tmp_path):
    other = {**CONFIG, "optimizer": {"params": {"lr": 0.05}}, "env": {"save_dir": "y"}}
    runs = [Run(write_run(tmp_path / "a", [_train(2, 1.0)], CONFIG)),
            Run(write_run(tmp_path / "b", [_train(2, 0.9)], other))]
    assert differing_keys([r.config for r in runs]) == ["optimizer.params.lr"]
    assert run_labels(runs) == ["optimizer.params.lr=0.01", "optimizer.params.lr=0.05"]
    same = [Run(write_run(tmp_path / "c", [_train(2, 1.0)], CONFIG)), runs[0]]
    assert run_labels(same) == ["c", "a"]  # nothing differs: the save dirs' names


def test_table_has_best_last_and_wall_time(tmp_path):
    run = Run(write_run(tmp_path / "a", [_train(2, 1.0, wall_s=1.0), _val(2, 0.5, 0.9, wall_s=12.34)], CONFIG))
    table = format_table([run], ["lr=0.01"]).splitlines()
    assert table[0].split() == ["run", "metric", "best", "at", "update", "last", "at", "update", "wall", "time"]
    assert table[1].split()[:6] == ["lr=0.01", "toy/cross_entropy", "0.9000", "2", "0.9000", "2"]
    assert table[1].endswith("12.3 s")


def test_resolve_metric_names():
    results = {"a": {"cross_entropy": 1.0, "accuracy": 0.5, "accuracy/x": 0.4}, "b": {"f1": 0.3}}
    assert resolve_metric("a/accuracy/x", results) == ("a", "accuracy/x")
    assert resolve_metric("b/f1", results) == ("b", "f1")
    assert resolve_metric("accuracy", results) == ("a", "accuracy")
    assert resolve_metric(None, results, losses=["cross_entropy"]) == ("a", "accuracy")
    with pytest.raises(UserError, match=r"--metric='a/acuracy'.*Did you mean 'accuracy'"):
        resolve_metric("a/acuracy", results, "--metric")
