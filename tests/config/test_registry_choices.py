"""Registries drive choices: the allowed values of registry-valued keys are what is registered,
after the built-ins and ``env.user_dir`` are imported; ``mmvl_run --list`` shows the user's entries."""
from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

from mmvl import registry
from mmvl.config import load_config
from mmvl.config.validate import CHOICES, REGISTERED
from mmvl.errors import UserError
from mmvl_cli.run import main

USER_CODE = '''
from mmvl.distributed.strategies.base import Strategy
from mmvl.registry import register_scheduler, register_strategy, register_trainer
from mmvl.trainers.trainer import Trainer


@register_strategy("{tag}_strategy")
class UserStrategy(Strategy):
    name = "{tag}_strategy"


@register_trainer("{tag}_trainer")
class UserTrainer(Trainer):
    pass


@register_scheduler("{tag}_scheduler")
def user_scheduler(optimizer, gamma: float = 0.5):
    import torch

    return torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma)
'''


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A user package registering a strategy, a trainer and a scheduler under fresh names."""
    monkeypatch.delenv("MMVL_USER_DIR", raising=False)
    tag = f"u{uuid.uuid4().hex[:8]}"
    pkg = tmp_path / f"mmvl_user_{tag}"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(USER_CODE.format(tag=tag))
    yield pkg, tag
    for reg, suffix in ((registry.STRATEGIES, "strategy"), (registry.TRAINERS, "trainer"),
                        (registry.SCHEDULERS, "scheduler")):
        reg.unregister(f"{tag}_{suffix}")
    sys.modules.pop(pkg.name, None)
    if str(pkg.parent) in sys.path:
        sys.path.remove(str(pkg.parent))


def test_no_registry_valued_key_has_a_fixed_list():
    assert not set(CHOICES) & set(REGISTERED)
    assert {"distributed.strategy", "training.trainer", "optimizer.type", "scheduler.type"} <= set(REGISTERED)


def test_user_registrations_are_accepted(user_dir, tmp_path):
    pkg, tag = user_dir
    cfg = load_config([f"env.user_dir={pkg}", f"distributed.strategy={tag}_strategy",
                       f"training.trainer={tag}_trainer", f"scheduler.type={tag}_scheduler",
                       f"env.save_dir={tmp_path}"])
    assert cfg.distributed.strategy == f"{tag}_strategy" and cfg.training.trainer == f"{tag}_trainer"

    from mmvl.distributed.env import DistEnv
    from mmvl.distributed.strategies import build_strategy

    assert type(build_strategy(cfg, DistEnv())).__name__ == "UserStrategy"


def test_without_the_user_dir_the_same_names_are_rejected_with_the_registered_ones(user_dir):
    pkg, tag = user_dir
    with pytest.raises(UserError) as err:
        load_config([f"distributed.strategy={tag}_strategy"])
    message = str(err.value)
    assert "'distributed.strategy' in command line must be one of auto, ddp, dp, fsdp" in message
    assert "register_strategy" in message and "env.user_dir" in message


def test_a_registration_changes_what_is_allowed():
    """The list is read from the registry at check time, not from a table."""
    name = f"temp_{uuid.uuid4().hex[:8]}"
    with pytest.raises(UserError, match=name):
        load_config([f"distributed.strategy={name}"])
    registry.STRATEGIES.register(name, type(name, (), {}))
    try:
        assert load_config([f"distributed.strategy={name}"]).distributed.strategy == name
    finally:
        registry.STRATEGIES.unregister(name)
    with pytest.raises(UserError, match=name):
        load_config([f"distributed.strategy={name}"])


@pytest.mark.parametrize("opt,needle", [
    ("distributed.strategy=ddpp", "Did you mean 'ddp'"),
    ("training.trainer=mmfv", "Did you mean 'mmvl'"),
    ("optimizer.type=adam_ww", "or any torch.optim class"),
    ("scheduler.type=warmup_cosin", "Did you mean 'warmup_cosine'"),
])
def test_unknown_registered_names_fail_at_load_time_naming_key_and_source(opt, needle):
    key = opt.split("=")[0]
    with pytest.raises(UserError, match=f"'{key}' in command line must be one of") as err:
        load_config([opt])
    assert needle in str(err.value)


@pytest.mark.parametrize("opt", ["optimizer.type=SGD", "optimizer.type=rmsprop", "scheduler.type=null",
                                 "distributed.strategy=auto"])
def test_registry_fallbacks_and_extra_values(opt):
    load_config([opt])


def test_fixed_choices_come_from_the_schema():
    from mmvl.config.schema import BACKENDS, LR_SCALINGS
    from mmvl.utils.precision import PRECISIONS

    assert CHOICES["training.precision"] == tuple(PRECISIONS)
    assert CHOICES["distributed.backend"] == BACKENDS
    assert set(LR_SCALINGS) < set(CHOICES["optimizer.lr_scaling"])
    assert REGISTERED["multitasking.type"] == ("multitasking", ())  # a registry, no private list


def test_list_shows_the_user_entries(user_dir, capsys, monkeypatch):
    pkg, tag = user_dir
    assert main(["--list", "strategy", f"env.user_dir={pkg}"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("strategy:") and f"{tag}_strategy" in out and "fsdp" in out
    assert main(["--list", f"env.user_dir={pkg}"]) == 0
    out = capsys.readouterr().out
    assert f"{tag}_trainer" in out and f"{tag}_scheduler" in out and "model:" in out


def test_list_takes_the_user_dir_from_a_config_file_or_the_environment(user_dir, capsys, monkeypatch, tmp_path):
    pkg, tag = user_dir
    config = tmp_path / "run.yaml"
    config.write_text(f"env:\n  user_dir: {pkg}\n")
    assert main(["--list", "trainer", f"config={config}"]) == 0
    assert f"{tag}_trainer" in capsys.readouterr().out
    monkeypatch.setenv("MMVL_USER_DIR", str(pkg))
    assert main(["--list", "scheduler"]) == 0
    assert f"{tag}_scheduler" in capsys.readouterr().out


def test_list_with_a_missing_user_dir_is_one_line(capsys, tmp_path):
    assert main(["--list", f"env.user_dir={tmp_path / 'nope'}"]) == 2
    err = capsys.readouterr().err
    assert "env.user_dir" in err and len(err.strip().splitlines()) == 1
