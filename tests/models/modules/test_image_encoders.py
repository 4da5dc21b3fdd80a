"""CNNEncoder: per-layer kernel sizes (a cheap strided stem) and their checks; ResNetEncoder's depths and
torchvision weights."""
from __future__ import annotations

import pytest
import torch

from mmvl.errors import UserError
from mmvl.models.modules.image_encoders import CNNEncoder, ResNetEncoder


def test_per_layer_kernel_sizes_set_each_conv():
    enc = CNNEncoder(channels=[8, 8, 16], strides=[4, 2, 2], kernel_size=[5, 3, 3])
    assert [stage[0].kernel_size for stage in enc.stages] == [(5, 5), (3, 3), (3, 3)]
    assert [stage[0].padding for stage in enc.stages] == [(2, 2), (1, 1), (1, 1)]
    assert enc(torch.randn(2, 3, 75, 75)).shape == (2, 16, 5, 5)  # 75 -> 19 -> 10 -> 5
    same = CNNEncoder(channels=[8, 8], kernel_size=3)
    assert [stage[0].kernel_size for stage in same.stages] == [(3, 3), (3, 3)]


def test_one_group_per_channel_normalises_each_channel_over_its_own_map():
    """``groups`` sets every layer's GroupNorm; with one group per channel (the easy-VQA Relation
    Network's setting) each channel of each image has mean 0 over its map, with the default 8 groups
    (3 channels a group) only each group's mean is 0."""
    torch.manual_seed(0)
    images = torch.randn(2, 3, 16, 16)
    per_channel = CNNEncoder(channels=[24, 24], groups=24, coords=False)
    default = CNNEncoder(channels=[24, 24], coords=False)
    assert [stage[1].num_groups for stage in per_channel.stages] == [24, 24]
    assert [stage[1].num_groups for stage in default.stages] == [8, 8]
    for enc, expect_zero in ((per_channel, True), (default, False)):
        conv, norm = enc.stages[0][0], enc.stages[0][1]
        with torch.no_grad():
            channel_means = norm(conv(images)).mean(dim=(2, 3))
        assert torch.allclose(channel_means, torch.zeros_like(channel_means), atol=1e-5) == expect_zero


def test_mismatched_lengths_are_user_errors():
    with pytest.raises(UserError, match="kernel sizes"):
        CNNEncoder(channels=[8, 8], kernel_size=[5, 3, 3])
    with pytest.raises(UserError, match="equal lengths"):
        CNNEncoder(channels=[8, 8], strides=[2])


@pytest.mark.slow
def test_a_torchvision_resnet152_state_dict_loads_as_mmbts_image_encoder(tmp_path):
    """MMBT's (and MMF's) ResNet-152 from a torchvision state dict: the trunk's outputs are torchvision's."""
    import torchvision
    from omegaconf import OmegaConf

    from mmvl.models.mmbt import MMBT

    torch.manual_seed(0)
    reference = torchvision.models.resnet152(weights=None).eval()
    path = tmp_path / "resnet152.pth"
    torch.save(reference.state_dict(), path)
    model = MMBT(OmegaConf.create({
        "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
        "vocab_size": 20, "num_labels": 2, "max_position_embeddings": 32,
        "image_encoder": {"type": "resnet", "params": {"depth": 152, "pretrained_path": str(path)}}})).eval()
    encoder = model.visual.image_encoder
    trunk = torch.nn.Sequential(*list(reference.children())[:-2])  # without avgpool and fc
    images = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(encoder(images), trunk(images))
    assert encoder.out_dim == reference.fc.in_features


def test_unknown_resnet_depths_name_the_choices():
    with pytest.raises(UserError, match=r"\[18, 34, 50, 101, 152\]"):
        ResNetEncoder(depth=200)
