"""An open_clip checkpoint (timm ViT image tower + open_clip's text transformer) loads into mmvl's clip
with open_clip's outputs; made here from a random-initialised open_clip model, nothing downloaded."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from mmvl.errors import UserError
from mmvl.models.clip import Clip

WIDTH, LAYERS, HEADS, CONTEXT, VOCAB, EMBED = 32, 2, 4, 16, 100, 24


def _open_clip(bias: float | None):
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

    torch.manual_seed(0)
    model = CLIP(EMBED, vision_cfg=CLIPVisionCfg(timm_model_name="vit_tiny_patch16_224", timm_model_pretrained=False,
                                                 timm_pool="avg", timm_proj="linear"),
                 text_cfg=CLIPTextCfg(context_length=CONTEXT, vocab_size=VOCAB, width=WIDTH, heads=HEADS,
                                      layers=LAYERS), init_logit_bias=bias, output_dict=True)
    with torch.no_grad():  # away from the init values, so a missed tensor shows
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return model.eval()


def _mmvl(path, bias: float | None) -> Clip:
    return Clip(OmegaConf.create({
        "vocab_size": VOCAB, "embed_dim": EMBED, "init_logit_scale": 0.0, "init_logit_bias": bias,
        "image_encoder": {"type": "timm", "params": {"model_name": "vit_tiny_patch16_224", "global_pool": "avg"}},
        "text_encoder": {"type": "transformer", "width": WIDTH, "layers": LAYERS, "heads": HEADS,
                         "context_length": CONTEXT},
        "open_clip_weights": str(path)})).eval()


@pytest.mark.slow  # ~10 s: two ViT-Tiny towers at 224 px, and open_clip's import
@pytest.mark.parametrize("bias", [None, -10.0])
def test_open_clip_checkpoint_gives_open_clips_outputs(tmp_path, bias):
    reference = _open_clip(bias)
    path = tmp_path / "open_clip.pt"
    torch.save(reference.state_dict(), path)
    model = _mmvl(path, bias)
    images = torch.randn(2, 3, 224, 224)
    # open_clip's tokenizer ends each text with its highest id (end of text), then pads with 0
    text = torch.tensor([[5, 17, 42, VOCAB - 1] + [0] * (CONTEXT - 4), [7, 3, VOCAB - 1] + [0] * (CONTEXT - 3)])
    with torch.no_grad():
        theirs = reference(images, text)
        ours = model({"image": images, "input_ids": text, "attention_mask": (text != 0).long()})
    for key in ("image_features", "text_features", "logit_scale") + (("logit_bias",) if bias else ()):
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=1e-5, msg=key)
    # a checkpoint of another size is refused, naming the mismatch
    with pytest.raises(UserError, match="does not fit"):
        Clip(OmegaConf.create({**OmegaConf.to_container(model.config), "embed_dim": EMBED + 1}))
