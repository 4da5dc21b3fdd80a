"""Registry contract: lookup, listing, suggestions for unknown names, duplicate names raise."""
from __future__ import annotations

import pytest
import torch

from mmvl import registry
from mmvl.errors import UserError
from mmvl.registry import Registry


def test_register_and_get():
    reg = Registry("widget")

    @reg.register("blue_widget")
    class Blue:
        pass

    assert reg.get("blue_widget") is Blue
    assert "blue_widget" in reg and reg.names() == ["blue_widget"]


def test_unknown_name_suggests_closest():
    reg = Registry("widget")
    reg.register("visual_bert", object())
    reg.register("concat_bert", object())
    with pytest.raises(UserError) as e:
        reg.get("visual_bret")
    msg = str(e.value)
    assert "widget" in msg and "'visual_bret'" in msg and "Did you mean 'visual_bert'" in msg
    assert "\n" not in msg


def test_duplicate_name_raises():
    reg = Registry("widget")
    reg.register("a", object())
    with pytest.raises(UserError, match="already registered"):
        reg.register("a", object())


def test_optimizer_falls_back_to_torch_optim():
    assert registry.OPTIMIZERS.get("SGD") is torch.optim.SGD
    assert registry.OPTIMIZERS.get("adamw") is torch.optim.AdamW
    with pytest.raises(UserError, match="optimizer"):
        registry.OPTIMIZERS.get("adam_ww_not_real")


def test_builtins_registered():
    import mmvl  # noqa: F401

    assert "visual_bert" in registry.MODELS
    assert "sort_of_clevr" in registry.DATASETS
    assert "mmvl" in registry.TRAINERS
    for name in ("checkpoint", "logging", "early_stop", "evaluation", "preemption", "profiler"):
        assert name in registry.CALLBACKS
    assert {"cross_entropy", "logit_bce"} <= set(registry.LOSSES.names())
    assert {"accuracy", "vqa_accuracy"} <= set(registry.METRICS.names())
