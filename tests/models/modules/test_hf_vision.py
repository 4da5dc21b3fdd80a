"""The ``hf_vision`` image encoder reads the tokens LLaVA reads: the same hidden states, with or
without the first token, of one layer or several, from a vision model or a whole CLIP folder; and it
refuses what does not fit in one line."""
from __future__ import annotations

import pytest
import torch

from mmvl.errors import UserError
from mmvl.models.modules import build_image_encoder
from tests.fixtures.vision_towers import IMAGE_SIZE, make_tower


@pytest.fixture(scope="module")
def towers(tmp_path_factory):
    root = tmp_path_factory.mktemp("towers")
    return {kind: make_tower(root / kind, kind) for kind in ("clip", "clip_vision_model", "siglip_vision_model")}


def _llava_features(folder, layer, strategy, images):
    """What transformers' LLaVA selects from this tower (before its projector)."""
    import transformers

    from mmvl.models.modules.hf_vision import vision_config

    config = vision_config(str(folder))
    cls = transformers.CLIPVisionModel if config.model_type.startswith("clip") else transformers.SiglipVisionModel
    tower = cls.from_pretrained(str(folder)).eval()
    states = tower(pixel_values=images, output_hidden_states=True).hidden_states
    layers = layer if isinstance(layer, list) else [layer]
    picked = [states[i][:, 1:] if strategy == "default" else states[i] for i in layers]
    return torch.cat(picked, -1)


@pytest.mark.parametrize("kind, layer, strategy, grid", [
    ("clip_vision_model", -2, "default", True), ("clip", -1, "default", True), ("clip_vision_model", -2, "full", False),
    ("siglip_vision_model", -1, "full", True), ("siglip_vision_model", [-3, -1], "default", False),
    ("clip_vision_model", [0, -2], "default", True)])
def test_the_tokens_are_llava_s(towers, kind, layer, strategy, grid):
    encoder = build_image_encoder({"type": "hf_vision", "params": {
        "path": str(towers[kind]), "vision_feature_layer": layer, "vision_feature_select_strategy": strategy}}).eval()
    images = torch.randn(2, 3, IMAGE_SIZE, IMAGE_SIZE)
    with torch.no_grad():
        out = encoder(images)
        want = _llava_features(towers[kind], layer, strategy, images)
    assert (out.dim() == 4) == grid
    tokens = out.flatten(2).transpose(1, 2) if grid else out
    assert tokens.shape == want.shape and tokens.size(1) == encoder.tokens_per_image()
    torch.testing.assert_close(tokens, want, rtol=1e-5, atol=1e-5)
    assert encoder.out_dim == want.size(-1)


def test_only_read_layers_are_kept_and_every_trained_weight_gets_a_gradient(towers):
    encoder = build_image_encoder({"type": "hf_vision", "params": {"path": str(towers["siglip_vision_model"]),
                                                                   "vision_feature_layer": -2}})
    tower = getattr(encoder.model, "vision_model", encoder.model)
    assert len(tower.encoder.layers) == 2  # of 3: the last is never read
    encoder(torch.randn(1, 3, IMAGE_SIZE, IMAGE_SIZE)).square().mean().backward()
    trained = [n for n, p in encoder.named_parameters() if p.requires_grad]
    assert trained and all(p.grad is not None for p in encoder.parameters() if p.requires_grad), \
        [n for n, p in encoder.named_parameters() if p.requires_grad and p.grad is None]


@pytest.mark.parametrize("params, needle", [
    ({"path": "/nowhere"}, "is not a folder"),
    ({"vision_feature_layer": 4}, "vision_feature_layer=4"),
    ({"vision_feature_layer": "last"}, "vision_feature_layer='last'"),
    ({"vision_feature_select_strategy": "cls"}, "vision_feature_select_strategy='cls'"),
])
def test_bad_settings_are_one_line(towers, params, needle):
    with pytest.raises(UserError, match=needle.replace("[", r"\[").replace("(", r"\(")):
        build_image_encoder({"type": "hf_vision", "params": {"path": str(towers["clip_vision_model"]), **params}})


def test_a_folder_of_another_model_and_a_wrong_image_size_are_one_line(towers, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=20, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(str(tmp_path / "lm"))
    with pytest.raises(UserError, match="holds a 'llama' model"):
        build_image_encoder({"type": "hf_vision", "params": {"path": str(tmp_path / "lm")}})
    encoder = build_image_encoder({"type": "hf_vision", "params": {"path": str(towers["clip_vision_model"])}})
    with pytest.raises(UserError, match="set the dataset's image size"):
        encoder(torch.randn(1, 3, 48, 48))


def test_activation_checkpointing_recomputes_the_same_gradients(towers):
    spec = {"type": "hf_vision", "params": {"path": str(towers["clip_vision_model"])}}
    images = torch.randn(2, 3, IMAGE_SIZE, IMAGE_SIZE)
    grads = []
    for checkpointed in (False, True):
        encoder = build_image_encoder(spec).train()
        if checkpointed:
            encoder.enable_gradient_checkpointing()
            assert encoder.model.is_gradient_checkpointing
        encoder(images).square().mean().backward()
        grads.append({n: p.grad for n, p in encoder.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-6)
