"""The typed schema and the shipped defaults agree key for key and value for value, and a field's
declaration is what the loader and the resume check act on."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from mmvl.config import load_config, schema
from mmvl.config.validate import CHOICES, POSITIVE_INT, REGISTERED
from mmvl.errors import UserError

DEFAULTS = Path(__file__).resolve().parents[2] / "configs" / "defaults.yaml"


def test_defaults_yaml_is_the_schema():
    assert yaml.safe_load(DEFAULTS.read_text()) == schema.defaults()


def test_every_closed_field_is_checked_by_the_loader():
    for key, f in schema.fields().items():
        if f.metadata.get("choices"):
            assert key in CHOICES
        if f.metadata.get("registry"):
            assert key in REGISTERED
        if f.metadata.get("positive"):
            assert key in POSITIVE_INT


@pytest.mark.parametrize("key", ["training.precision", "distributed.backend", "training.pin_memory"])
def test_a_choice_outside_the_declared_set_is_one_line(key):
    with pytest.raises(UserError, match=f"Config key '{key}' in command line must be one of"):
        load_config([f"{key}=fp8"])


def test_resume_safety_is_declared_per_field_or_section():
    assert schema.resume_safe("training.log_interval") and not schema.resume_safe("training.seed")
    assert schema.resume_safe("training.profiler.active")  # the section is safe
    assert schema.resume_safe("checkpoint.reset.counts") and schema.resume_safe("env.save_dir")
    assert not schema.resume_safe("optimizer.params.lr") and not schema.resume_safe("model_config.m.hidden")
    # the optimizer's implementation is the config's (a loaded state keeps the built one)
    assert schema.resume_safe("optimizer.params.fused") and schema.resume_safe("optimizer.params.foreach")


def test_a_new_safe_field_is_one_declaration():
    @dataclasses.dataclass
    class Extra:
        knob_a: int = schema.knob(3, safe=True)
        knob_b: int = schema.knob(3)

    declared = {f.name: f.metadata["safe"] for f in dataclasses.fields(Extra)}
    assert declared == {"knob_a": True, "knob_b": False}


def test_sections_are_typed():
    config = load_config(["training.batch_size=64", "distributed.strategy=ddp"])
    training = schema.section(config, "training")
    assert isinstance(training, schema.Training) and training.batch_size == 64
    assert isinstance(training.profiler, schema.Profiler) and training.profiler.wait == 5
    assert schema.section(config, "distributed").strategy == "ddp"
    assert schema.stages(config) == {"train", "val"}
