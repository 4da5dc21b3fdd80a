"""CNNEncoder: per-layer kernel sizes (a cheap strided stem) and their checks."""
from __future__ import annotations

import pytest
import torch

from mmvl.errors import UserError
from mmvl.models.modules.image_encoders import CNNEncoder


def test_per_layer_kernel_sizes_set_each_conv():
    enc = CNNEncoder(channels=[8, 8, 16], strides=[4, 2, 2], kernel_size=[5, 3, 3])
    assert [stage[0].kernel_size for stage in enc.stages] == [(5, 5), (3, 3), (3, 3)]
    assert [stage[0].padding for stage in enc.stages] == [(2, 2), (1, 1), (1, 1)]
    assert enc(torch.randn(2, 3, 75, 75)).shape == (2, 16, 5, 5)  # 75 -> 19 -> 10 -> 5
    same = CNNEncoder(channels=[8, 8], kernel_size=3)
    assert [stage[0].kernel_size for stage in same.stages] == [(3, 3), (3, 3)]


def test_mismatched_lengths_are_user_errors():
    with pytest.raises(UserError, match="kernel sizes"):
        CNNEncoder(channels=[8, 8], kernel_size=[5, 3, 3])
    with pytest.raises(UserError, match="equal lengths"):
        CNNEncoder(channels=[8, 8], strides=[2])
