"""MMF's freeze switches become parts of ``model_config.<model>.freeze`` (they used to be dropped)."""
from __future__ import annotations

import pytest

from mmvl.config.mmf import FREEZE_PARTS, translate


@pytest.mark.parametrize("switch", sorted(FREEZE_PARTS))
def test_each_switch_names_its_part_and_false_freezes_nothing(switch):
    unused: list = []
    on = translate({"model_config": {"mmbt": {switch: True}}}, {}, "run.yaml", unused)
    assert on == {"model_config": {"mmbt": {"freeze": [FREEZE_PARTS[switch]]}}}
    assert translate({"model_config": {"mmbt": {switch: False}}}, {}, "run.yaml", unused) == {}
    assert not unused  # neither is reported as ignored


def test_switches_and_a_freeze_list_in_one_layer_merge():
    layer = {"model_config": {"mmbt": {"freeze_text": True, "freeze": ["classifier", "text_encoder"],
                                       "freeze_modal": True}}}
    out = translate(layer, {}, "run.yaml", [])
    assert out["model_config"]["mmbt"]["freeze"] == ["text_encoder", "classifier", "image_encoder"]


def test_an_empty_freeze_list_still_replaces_a_lower_layer():
    assert translate({"model_config": {"mmbt": {"freeze": []}}}, {}, "cli", []) == {
        "model_config": {"mmbt": {"freeze": []}}}
