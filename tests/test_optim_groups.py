"""Parameter groups from the config: no decay for gains, biases and logit_scale/logit_bias, per-part
learning rates, and layer-wise lr decay over timm's and open_clip's ViT block names (checked per parameter)."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from mmvl.errors import UserError
from mmvl.optim import base_lr, build_optimizer, build_scheduler, optimizer_section, scheduler_section
from tests.fixtures.two_tower import TinyTwoTower

LR, WD = 1e-3, 0.1


def build(model, **optimizer):
    cfg = OmegaConf.create({"optimizer": {"type": "adam_w", "params": {"lr": LR, "weight_decay": WD}, **optimizer},
                            "training": {"batch_size": 8, "max_updates": 10}})
    return build_optimizer(model, optimizer_section(cfg)), cfg


def per_parameter(model, opt) -> dict[str, tuple[float, float]]:
    """name -> (lr, weight_decay) of the group holding it."""
    of = {id(p): (g["lr"], g["weight_decay"]) for g in opt.param_groups for p in g["params"]}
    return {n: of[id(p)] for n, p in model.named_parameters() if p.requires_grad}


def test_gains_biases_and_logit_scale_do_not_decay():
    model = TinyTwoTower()
    model.logit_bias = torch.nn.Parameter(torch.zeros(()))
    got = per_parameter(model, build(model)[0])
    no_decay = {"visual.1.bias", "visual.2.weight", "visual.2.bias", "visual.3.bias", "logit_scale", "logit_bias"}
    assert {n for n, (_, wd) in got.items() if wd == 0.0} == no_decay
    assert all(wd == WD and lr == LR for n, (lr, wd) in got.items() if n not in no_decay)
    everything = per_parameter(model, build(model, no_weight_decay=[])[0])  # [] : the names decay again
    assert everything["logit_scale"] == (LR, WD) and everything["visual.2.weight"] == (LR, 0.0)


def test_per_part_learning_rates_first_rule_wins():
    model = TinyTwoTower()
    rules = [{"match": "visual.3", "lr": 5e-5}, {"match": "visual", "lr_scale": 0.1},
             {"match": "*.weight", "weight_decay": 0.3}, {"match": "logit_scale", "lr_scale": 2.0}]
    opt, cfg = build(model, param_groups=rules)
    got = per_parameter(model, opt)
    assert got["visual.3.weight"] == (5e-5, WD) and got["visual.3.bias"] == (5e-5, 0.0)
    assert got["visual.1.weight"] == (pytest.approx(LR * 0.1), WD) and got["visual.2.weight"][1] == 0.0
    assert got["token_embedding.weight"] == (LR, 0.3) and got["text_projection.weight"] == (LR, 0.3)
    assert got["logit_scale"] == (pytest.approx(2 * LR), 0.0)
    assert base_lr(opt) == LR
    scheduler = build_scheduler(opt, scheduler_section({"scheduler": {"type": "warmup_linear", "params": {
        "num_warmup_steps": 0, "num_training_steps": 10}}}), max_updates=10)
    opt.step(), scheduler.step()
    after = per_parameter(model, opt)  # every group on the same schedule: the ratios hold
    assert after["visual.1.weight"][0] / after["token_embedding.weight"][0] == pytest.approx(0.1)


def _timm_vit():
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(img_size=16, patch_size=8, embed_dim=8, depth=3, num_heads=2, num_classes=4)


def _open_clip():
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

    return CLIP(embed_dim=8, vision_cfg=CLIPVisionCfg(layers=2, width=16, head_width=8, patch_size=8, image_size=16),
                text_cfg=CLIPTextCfg(context_length=8, vocab_size=50, width=16, heads=2, layers=3))


def _expected_timm(name: str, d: float) -> float:
    if name.startswith("blocks."):
        return d ** (3 - int(name.split(".")[1]))
    return d ** 4 if name.split(".")[0] in ("cls_token", "pos_embed", "patch_embed") else 1.0


def _expected_open_clip(name: str, d: float) -> float:
    if name.startswith("visual.transformer.resblocks."):
        return d ** (2 - int(name.split(".")[3]))
    if name.startswith("transformer.resblocks."):
        return d ** (3 - int(name.split(".")[2]))
    if name.split(".")[:2] in (["visual", "conv1"], ["visual", "class_embedding"], ["visual", "positional_embedding"],
                               ["visual", "ln_pre"]):
        return d ** 3
    return d ** 4 if name.split(".")[0] in ("token_embedding", "positional_embedding") else 1.0


@pytest.mark.parametrize("make,expected", [(_timm_vit, _expected_timm), (_open_clip, _expected_open_clip)],
                         ids=["timm", "open_clip"])
def test_layer_decay_per_block(make, expected):
    model = make()
    got = per_parameter(model, build(model, layer_decay=0.5)[0])
    assert len({lr for lr, _ in got.values()}) > 3  # really spread over the layers
    for name, (lr, _) in got.items():
        assert lr == pytest.approx(LR * expected(name, 0.5)), name
    assert per_parameter(model, build(model)[0]) == {n: (LR, got[n][1]) for n in got}  # 1.0: off


def test_layer_decay_with_a_scale_rule_multiplies():
    model = _open_clip()
    got = per_parameter(model, build(model, layer_decay=0.5, param_groups=[{"match": "visual", "lr_scale": 0.1}])[0])
    assert got["visual.transformer.resblocks.0.mlp.c_fc.weight"][0] == pytest.approx(LR * 0.1 * 0.25)
    assert got["transformer.resblocks.2.mlp.c_fc.weight"][0] == pytest.approx(LR * 0.5)
    assert got["logit_scale"] == (LR, 0.0)


@pytest.mark.parametrize("optimizer,needle", [
    ({"param_groups": [{"lr_scale": 0.1}]}, "needs a 'match'"),
    ({"param_groups": [{"match": "visual"}]}, "one of 'lr_scale' or 'lr'"),
    ({"param_groups": [{"match": "visual", "lr": 1e-4, "lr_scale": 0.1}]}, "one of 'lr_scale' or 'lr'"),
    ({"param_groups": [{"match": "visual", "lr_scale": -1}]}, "must be a number >= 0"),
    ({"layer_decay": 1.5}, "must be in \\(0, 1\\]"),
    ({"layer_decay": 0.7}, "no numbered blocks"),
])
def test_user_errors(optimizer, needle):
    with pytest.raises(UserError, match=needle):
        build(TinyTwoTower(), **optimizer)
