"""visual_bert: shapes per image encoder, batch independence, checkpointing, pretrained init, errors."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from mmvl.errors import UserError
from mmvl.models import VisualBert
from mmvl.models.modules.image_encoders import add_coords, build_image_encoder
from mmvl.registry import MODELS

ENCODERS = {
    "cnn": {"type": "cnn", "params": {"channels": [8, 8, 16, 16]}},
    "patch": {"type": "patch", "params": {"patch_size": 15, "out_dim": 16}},
    "resnet": {"type": "resnet", "params": {"depth": 18, "stages": 1}},
    "film_cnn": {"type": "film_cnn", "params": {"film_channels": 4, "channels": [8, 8, 16, 16]}},
    "film_every_layer": {"type": "film_cnn", "params": {"pixel_layer": False, "every_layer": True,
                                                        "channels": [8, 8, 16, 16]}},
    "film_last_layer": {"type": "film_cnn", "params": {"pixel_layer": False, "film_layers": [3],
                                                       "channels": [8, 8, 16, 16]}},
    "film_two_views": {"type": "film_cnn", "params": {"pixel_layer": False, "every_layer": True,
                                                      "unconditioned_view": True, "channels": [8, 8, 16, 16]}},
}


def tiny(**overrides) -> VisualBert:
    cfg = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
           "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "vocab_size": 20, "num_labels": 7,
           "max_position_embeddings": 32, "image_encoder": ENCODERS["cnn"]}
    cfg.update(overrides)
    torch.manual_seed(0)
    return VisualBert(OmegaConf.create(cfg))


def batch(n: int = 3, size: int = 75) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 20, (n, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0  # a padded question
    ids[0, 6:] = 0
    return {"image": torch.randn(n, 3, size, size, generator=g), "input_ids": ids, "attention_mask": mask,
            "token_type_ids": torch.zeros_like(ids), "targets": torch.tensor([0, 1, 2][:n])}


def test_registered():
    assert MODELS.get("visual_bert") is VisualBert


@pytest.mark.parametrize("kind", sorted(ENCODERS))
def test_forward_shapes_per_encoder(kind):
    model = tiny(image_encoder=ENCODERS[kind])
    out = model(batch())
    assert out["scores"].shape == (3, 7)
    out["scores"].sum().backward()
    first = next(model.image_encoder.parameters())
    assert first.grad is not None and first.grad.abs().sum() > 0  # gradients reach the pixels' encoder


@pytest.mark.parametrize("kind", sorted(ENCODERS))
def test_no_batchnorm_and_batch_independent(kind):
    model = tiny(image_encoder=ENCODERS[kind]).train()
    assert not [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    b = batch()
    full = model(b)["scores"]
    single = model({k: v[1:2] for k, v in b.items()})["scores"]
    torch.testing.assert_close(full[1:2], single, rtol=1e-4, atol=1e-5)


def test_padding_does_not_change_scores():
    model = tiny().eval()
    b = batch()
    short = {k: (v[:1, :6] if k in ("input_ids", "attention_mask", "token_type_ids") else v[:1]) for k, v in b.items()}
    torch.testing.assert_close(model(b)["scores"][:1], model(short)["scores"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["cnn", "film_every_layer", "film_last_layer", "film_two_views"])
def test_gradient_checkpointing_gives_same_gradients(kind):
    b = batch()
    plain, ckpt = tiny(image_encoder=ENCODERS[kind]).train(), tiny(image_encoder=ENCODERS[kind]).train()
    ckpt.enable_gradient_checkpointing()
    grads = []
    for model in (plain, ckpt):
        nn.functional.cross_entropy(model(b)["scores"], b["targets"]).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-6)


def test_shard_units_are_the_bert_layers():
    model = tiny(num_hidden_layers=3)
    units = model.shard_units()
    assert len(units) == 3 and all(type(u).__name__ == "BertLayer" for u in units)


def test_user_errors():
    with pytest.raises(UserError, match="does-not-exist"):
        tiny(text_encoder={"pretrained_path": "/does-not-exist/bert"})
    with pytest.raises(UserError, match="vocab_size"):
        tiny(vocab_size=None)
    with pytest.raises(UserError, match="num_labels"):
        tiny(num_labels=None)
    with pytest.raises(UserError, match="patch"):
        build_image_encoder({"type": "pach"})
    with pytest.raises(UserError, match="weights.pt"):
        build_image_encoder({"type": "resnet", "params": {"pretrained_path": "/nowhere/weights.pt"}})
    with pytest.raises(UserError, match="every_layer"):
        build_image_encoder({"type": "film_cnn", "params": {"cond_dim": 8, "pixel_layer": False}})
    with pytest.raises(UserError, match="max_grid_size"):
        tiny(max_grid_size=2)(batch())


def test_resnet_loads_local_weights(tmp_path):
    import torchvision
    from torchvision.ops.misc import FrozenBatchNorm2d

    reference = torchvision.models.resnet18(weights=None)
    torch.save(reference.state_dict(), tmp_path / "r18.pt")
    encoder = build_image_encoder({"type": "resnet", "params": {"stages": 1, "pretrained_path": str(tmp_path / "r18.pt")}})
    torch.testing.assert_close(encoder.stages[0][0][0].weight, reference.conv1.weight)
    assert any(isinstance(m, FrozenBatchNorm2d) for m in encoder.modules())


def test_minilm_init_equals_checkpoint():
    from safetensors.torch import load_file

    from mmvl.data.processors.text import minilm_dir

    model = tiny(vocab_size=None, text_encoder={"pretrained_path": "minilm"})
    reference = load_file(str(minilm_dir() / "model.safetensors"))
    own = model.bert.state_dict()
    compared = 0
    for key, value in reference.items():
        if key in own:
            torch.testing.assert_close(own[key], value)
            compared += 1
    assert compared >= 100 and model.bert.config.hidden_size == 384
    assert model(batch())["scores"].shape == (3, 7)
    with pytest.raises(UserError, match="vocab_size"):
        tiny(vocab_size=31, text_encoder={"pretrained_path": "minilm"})


@pytest.mark.parametrize("kind", ["film_cnn", "film_every_layer", "film_last_layer", "film_two_views"])
def test_film_cnn_depends_on_the_question(kind):
    model = tiny(image_encoder=ENCODERS[kind]).eval()
    if kind != "film_cnn":  # FiLM starts as the identity; give it something to modulate
        for film in model.image_encoder.layer_films.values():
            torch.nn.init.normal_(film.weight, std=0.5)
    b = batch()
    other = dict(b, input_ids=b["input_ids"].flip(1))
    grid_a = model._encode_image(b)
    grid_b = model._encode_image(other)
    assert not torch.allclose(grid_a, grid_b)  # same pixels, other words -> other visual tokens


def test_film_layers_leave_the_other_layers_unconditioned():
    model = tiny(image_encoder=ENCODERS["film_last_layer"]).eval()
    assert list(model.image_encoder.layer_films) == ["3"]
    for film in model.image_encoder.layer_films.values():
        torch.nn.init.normal_(film.weight, std=0.5)
    seen = []
    model.image_encoder.stages[2].register_forward_hook(lambda _m, _i, out: seen.append(out))
    b = batch()
    final = [model._encode_image(b), model._encode_image(dict(b, input_ids=b["input_ids"].flip(1)))]
    torch.testing.assert_close(seen[0], seen[1])  # layers 0-2 see only pixels
    assert not torch.allclose(final[0], final[1])  # the last one hears the question
    with pytest.raises(UserError, match="out of range"):
        build_image_encoder({"type": "film_cnn", "params": {"cond_dim": 8, "pixel_layer": False, "film_layers": [4],
                                                             "channels": [8, 8, 16, 16]}})
    with pytest.raises(UserError, match="both set"):
        build_image_encoder({"type": "film_cnn", "params": {"cond_dim": 8, "every_layer": True, "film_layers": [1]}})


def test_unconditioned_view_is_the_plain_encoder_beside_the_film_one():
    model = tiny(image_encoder=ENCODERS["film_two_views"]).eval()
    enc = model.image_encoder
    assert enc.out_dim == 32
    for film in enc.layer_films.values():
        torch.nn.init.normal_(film.weight, std=0.5)
    b = batch()
    grid = model._encode_image(b)
    other = model._encode_image(dict(b, input_ids=b["input_ids"].flip(1)))
    plain = enc.run_stages(add_coords(b["image"]))  # the same filters, no question
    torch.testing.assert_close(grid[:, :16], plain)
    torch.testing.assert_close(other[:, :16], plain)
    assert not torch.allclose(grid[:, 16:], other[:, 16:])
    with pytest.raises(UserError, match="pixel_layer: false"):
        build_image_encoder({"type": "film_cnn", "params": {"cond_dim": 8, "unconditioned_view": True}})


def test_pools_head_reads_the_mean_and_max_of_the_real_visual_tokens():
    from mmvl.models.visual_bert import masked_mean_max

    tokens = torch.tensor([[[1.0, -1.0], [3.0, -5.0], [100.0, 100.0]]])
    mean, maxed = masked_mean_max(tokens, torch.tensor([[1, 1, 0]]))
    torch.testing.assert_close(mean, torch.tensor([[2.0, -3.0]]))
    torch.testing.assert_close(maxed, torch.tensor([[3.0, -1.0]]))  # the padded token is ignored
    _, none = masked_mean_max(tokens, torch.zeros(1, 3, dtype=torch.long))
    torch.testing.assert_close(none, torch.zeros(1, 2))
    model = tiny(classifier_input="pooled_and_pools").eval()
    assert model.classifier[1].in_features == 3 * 32
    b = batch()
    scores = model(b)["scores"]
    assert scores.shape == (3, 7)
    torch.testing.assert_close(model({k: v[1:2] for k, v in b.items()})["scores"], scores[1:2], rtol=1e-4, atol=1e-5)
    regions = tiny(classifier_input="pooled_and_pools", feature_dim=6)  # no fixed grid needed
    assert regions.classifier[1].in_features == 3 * 32
    everything = tiny(classifier_input=["pooled", "visual", "mean", "max"], image_size=75)
    assert everything.classifier[1].in_features == (1 + 25 + 2) * 32
    assert everything(b)["scores"].shape == (3, 7)
    for bad in (["pooled", "pooled"], ["cls"], "visual_only"):
        with pytest.raises(UserError, match="classifier_input"):
            tiny(classifier_input=bad)
    with pytest.raises(UserError, match="fixed image grid"):
        tiny(classifier_input="pooled_and_visual", feature_dim=6)


def test_pooled_and_visual_head_reads_every_visual_token():
    model = tiny(classifier_input="pooled_and_visual", image_size=75).eval()
    assert model.num_visual_tokens == 25  # four stride-2 layers: 75 -> 5x5
    b = batch()
    assert model(b)["scores"].shape == (3, 7)
    with pytest.raises(UserError, match="image_size"):
        model(batch(size=45))
    with pytest.raises(UserError, match="classifier_input"):
        tiny(classifier_input="flat")


def test_pretrained_text_encoder_learns_at_its_lr_multiplier():
    from mmvl.optim import build_optimizer, optimizer_section

    model = tiny(vocab_size=None, initializer_range=0.1,
                 text_encoder={"pretrained_path": "minilm", "num_layers": 1, "lr_multiplier": 0.1})
    assert len(model.bert.encoder.layer) == 1 and model.bert.config.num_hidden_layers == 1
    assert model.visual_embeddings.proj.weight.std().item() == pytest.approx(0.1, rel=0.2)  # new layers' init
    opt = build_optimizer(model, optimizer_section({"optimizer": {"type": "adam_w", "params": {"lr": 1e-3}}}))
    lr_of = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        assert lr_of[id(p)] == pytest.approx(1e-4 if name.startswith("bert.") else 1e-3), name
    # random-initialised text encoder: the multiplier does not apply
    plain = tiny(text_encoder={"lr_multiplier": 0.1})
    opt = build_optimizer(plain, optimizer_section({"optimizer": {"type": "adam_w", "params": {"lr": 1e-3}}}))
    assert {g["lr"] for g in opt.param_groups} == {1e-3}
    with pytest.raises(UserError, match="lr_multiplier"):
        tiny(vocab_size=None, text_encoder={"pretrained_path": "minilm", "lr_multiplier": -1}).lr_multipliers()
