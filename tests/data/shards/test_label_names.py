"""``label_names``: an image-text item's ``label`` is the class its own caption names, for zero-shot evaluation."""
from __future__ import annotations

import numpy as np
import pytest

from mmvl.data.datasets.image_text_shards import SampleMaker
from mmvl.errors import UserError


def _maker(names):
    tokens = lambda text: {"input_ids": [len(text)]}  # noqa: E731
    return SampleMaker("image_text_shards", tokens, None, 0.0, 0, False, None, np.zeros(1), names)


def test_label_is_the_one_class_the_own_caption_names():
    maker = _maker(["red", "green", "blue"])
    assert maker.label_of("a Green square at the top left") == 1
    item = maker.item(7, None, "a red square", 0, None, own_caption="a blue square")  # a negative's caption
    assert item["label"] == 2 and item["targets"] == 0
    for caption in ("a greenish square", "a red and blue square"):  # whole words, exactly one
        with pytest.raises(UserError, match="label_names"):
            maker.label_of(caption)
    assert "label" not in _maker([]).item(7, None, "a red square", 1, None)
