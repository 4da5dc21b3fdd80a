"""Naming trackers (``log_with``, ``training.trackers``): what resolves, what is a one-line error."""
from __future__ import annotations

import importlib.util

import pytest

from mmvl import registry, tracking
from mmvl.config import load_config
from mmvl.errors import UserError
from mmvl.tracking.base import flat
from mmvl.tracking.wandb import wandb_mode
from mmvl.trainers.callbacks.trackers import active_trackers
from tests.fixtures.toy import register, toy_opts

register()
BUILT_IN = ("tensorboard", "wandb", "mlflow")


def _missing(monkeypatch, package: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))


def test_the_built_ins_are_registered():
    assert set(BUILT_IN) <= set(registry.TRACKERS.names())


def test_all_is_every_installed_tracker(monkeypatch):
    everything = [n for n in registry.TRACKERS.names() if tracking.installed(n)]
    assert tracking.resolve("all") == everything
    _missing(monkeypatch, "wandb")
    assert "wandb" not in tracking.resolve("all") and len(tracking.resolve("all")) == len(everything) - 1


def test_a_name_a_list_and_repeats():
    assert tracking.resolve("tensorboard") == ["tensorboard"]
    assert tracking.resolve(["mlflow", "tensorboard", "mlflow"]) == ["mlflow", "tensorboard"]
    assert tracking.resolve(None) == []


def test_an_unknown_name_suggests_the_registered_one():
    with pytest.raises(UserError, match=r"unknown tracker 'wandbb'.*wandb"):
        tracking.resolve(["wandbb"])


def test_a_tracker_without_its_package_names_the_install(monkeypatch):
    _missing(monkeypatch, "mlflow")
    with pytest.raises(UserError, match=r"mlflow package is not installed; pip install 'mmvl\[trackers\]'"):
        tracking.resolve("mlflow")


def test_a_ready_tracker_object_is_used_as_given(tmp_path):
    class Mine(tracking.Tracker):
        name = "mine"

    mine = Mine("p", str(tmp_path))
    assert tracking.start(tracking.resolve(["tensorboard", mine])[1:], "p", str(tmp_path)) == [mine]


def test_init_kwargs_for_a_tracker_that_does_not_exist_are_refused(tmp_path):
    with pytest.raises(UserError, match="init_kwargs names wandbx"):
        tracking.start([], "p", str(tmp_path), {"wandbx": {}})


def test_nested_config_is_flattened_lists_as_json():
    assert flat({"a": {"b": 1, "c": [1, 2]}, "d": None, "e": {}}) == {"a.b": 1, "a.c": "[1, 2]", "d": None, "e": "{}"}


@pytest.mark.parametrize("environ, kwargs, mode", [
    ({}, {}, "offline"),                                  # no key: never reach for the network
    ({"WANDB_API_KEY": "k"}, {}, "online"),
    ({"WANDB_API_KEY": "k", "WANDB_MODE": "offline"}, {}, "offline"),
    ({}, {"mode": "disabled"}, "disabled"),
])
def test_wandb_is_offline_without_a_key(environ, kwargs, mode):
    assert wandb_mode(kwargs, environ) == mode


def test_training_trackers_are_checked_at_load(tmp_path):
    with pytest.raises(UserError, match=r"training.trackers.*tensorbord.*tensorboard"):
        load_config(toy_opts(tmp_path, "training.trackers=[tensorbord]"))


@pytest.mark.parametrize("switch, trackers, expected", [
    ("auto", "[tensorboard, mlflow]", ["tensorboard", "mlflow"]),
    ("false", "[tensorboard, mlflow]", ["mlflow"]),
    ("true", "[wandb]", ["wandb", "tensorboard"]),
])
def test_training_tensorboard_keeps_adds_or_drops_it(tmp_path, switch, trackers, expected):
    config = load_config([*toy_opts(tmp_path), f"training.tensorboard={switch}", f"training.trackers={trackers}"])
    assert active_trackers(config) == expected


def test_mmf_wandb_keys_map_onto_the_trackers(tmp_path, caplog):
    user = tmp_path / "mmf.yaml"
    user.write_text("training:\n  wandb:\n    enabled: true\n    project: vqa\n    entity: me\n"
                    "env:\n  wandb_logdir: /tmp/wb\n  tensorboard_logdir: /tmp/tb\n")
    config = load_config([*toy_opts(tmp_path), f"config={user}"])
    assert list(config.training.trackers) == ["tensorboard", "wandb"]
    assert config.training.tracker_project == "vqa"
    assert (config.env.wandb_logdir, config.env.tensorboard_logdir) == ("/tmp/wb", "/tmp/tb")
    off = tmp_path / "off.yaml"
    off.write_text("training:\n  wandb:\n    enabled: false\n")
    assert list(load_config([*toy_opts(tmp_path), f"config={off}"]).training.trackers) == ["tensorboard"]
