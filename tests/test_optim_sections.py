"""The optimizer and scheduler builders take their typed sections (mmvl.config.schema.Optimizer,
Scheduler), never the whole config through dotted ``config_value(`` look-ups; reading a section
from a config never lets a schema default stand in for a type the config does not name."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from mmvl.config import schema
from mmvl.errors import UserError
from mmvl.optim import build_optimizer, build_scheduler, optimizer_section, scheduler_section

ROOT = Path(__file__).resolve().parents[1]


def test_no_config_value_in_optim():
    calls = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / "mmvl" / "optim").rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1) if "config_value(" in line]
    assert calls == [], "read the typed section instead: " + ", ".join(calls)


def test_the_builders_take_typed_sections():
    model = torch.nn.Linear(3, 2)
    section = schema.Optimizer(type="sgd", params={"lr": 0.4}, lr_scaling="linear")
    optimizer = build_optimizer(model, section, batch_size=512)  # the global batch the lr scales by
    assert type(optimizer) is torch.optim.SGD and optimizer.param_groups[0]["lr"] == pytest.approx(0.8)
    scheduler = build_scheduler(optimizer, schema.Scheduler(type="warmup_linear", params={"num_warmup_steps": 1}),
                                max_updates=3)
    assert scheduler.lr_lambdas[0](2) == pytest.approx(0.5)  # num_training_steps from max_updates
    assert build_scheduler(optimizer, schema.Scheduler(type=None)) is None
    config = OmegaConf.create({"optimizer": {"type": "sgd", "params": {"lr": 0.1}}})
    with pytest.raises(TypeError, match="optimizer_section"):
        build_optimizer(model, config)  # the whole config is not a section
    with pytest.raises(TypeError, match="scheduler_section"):
        build_scheduler(optimizer, config)


@pytest.mark.parametrize("config", [{}, {"optimizer": None}, {"optimizer": {}}, {"optimizer": {"type": None}},
                                    {"optimizer": {"params": {"lr": 0.1}}}])
def test_a_config_without_an_optimizer_type_is_refused_not_given_adam_w(config):
    with pytest.raises(UserError, match=r"config has no optimizer\.type; set e\.g\."):
        optimizer_section(OmegaConf.create(config))
    with pytest.raises(UserError, match=r"config has no optimizer\.type"):
        build_optimizer(torch.nn.Linear(2, 2), schema.Optimizer(type=None))


def test_absent_params_are_none_not_the_default_types():
    """The schema's default params are adam_w's (eps ...): a config naming sgd without params passes none."""
    section = optimizer_section({"optimizer": {"type": "sgd"}})
    assert section.params == {} and section.layer_decay == 1.0  # other fields: the schema's defaults
    assert type(build_optimizer(torch.nn.Linear(2, 2), section)) is torch.optim.SGD
    assert scheduler_section({"scheduler": {"type": "constant"}}).params == {}


@pytest.mark.parametrize("config", [{}, {"scheduler": None}, {"scheduler": {}}, {"scheduler": {"type": None}}])
def test_no_scheduler_is_no_schedule_not_the_default_one(config):
    assert scheduler_section(OmegaConf.create(config)).type is None


def test_scheduler_section_keeps_a_bare_name_and_refuses_unknown_keys():
    assert scheduler_section({"scheduler": "constant"}) == schema.Scheduler(type="constant", params={})
    with pytest.raises(UserError, match=r"scheduler has unknown keys \['warmup'\]"):
        scheduler_section({"scheduler": {"type": "constant", "warmup": 3}})


def test_lr_scaling_without_a_base_lr_is_refused_but_none_means_no_scaling():
    with pytest.raises(UserError, match="optimizer.lr_scaling is set but optimizer.params.lr is missing"):
        build_optimizer(torch.nn.Linear(2, 2), schema.Optimizer(type="adam_w", params={}, lr_scaling="sqrt"),
                        batch_size=64)
    unscaled = build_optimizer(torch.nn.Linear(2, 2), schema.Optimizer(type="adam_w", params={}, lr_scaling="none"))
    assert unscaled.param_groups[0]["lr"] == torch.optim.AdamW([torch.zeros(1)]).defaults["lr"]
