"""mmbt and concat_bert: shapes, pixel and region inputs, batch/padding independence,
checkpointing, FSDP units, MiniLM initialisation and user errors."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from mmvl.errors import UserError
from mmvl.models.concat_bert import ConcatBert
from mmvl.models.mmbt import MMBT, pool_tokens
from mmvl.registry import MODELS

MODELS_UNDER_TEST = {"mmbt": MMBT, "concat_bert": ConcatBert}
TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "classifier_dropout": 0.0,
        "vocab_size": 20, "num_labels": 5, "max_position_embeddings": 32,
        "image_encoder": {"type": "cnn", "params": {"channels": [8, 16], "strides": [4, 4]}}}


def tiny(name: str, **overrides) -> nn.Module:
    torch.manual_seed(0)
    return MODELS_UNDER_TEST[name](OmegaConf.create({**TINY, **overrides}))


def batch(n: int = 3, regions: bool = False) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 20, (n, 9), generator=g)
    ids[:, 0], ids[:, -1] = 2, 3  # [CLS] ... [SEP]
    mask = torch.ones_like(ids)
    ids[0, 6:], mask[0, 6:] = 0, 0  # a padded text...
    ids[0, 5] = 3  # ...ending in its own [SEP]
    out = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids),
           "targets": torch.tensor([0, 1, 2, 3][:n])}
    if regions:
        out["features"] = torch.randn(n, 4, 6, generator=g)
        out["boxes"] = torch.rand(n, 4, 4, generator=g)
        out["feature_mask"] = torch.tensor([[1, 1, 1, 0]] + [[1, 1, 1, 1]] * (n - 1))
    else:
        out["image"] = torch.randn(n, 3, 32, 32, generator=g)
    return out


@pytest.mark.parametrize("name", sorted(MODELS_UNDER_TEST))
def test_registered_and_shapes_with_gradients(name):
    assert MODELS.get(name) is MODELS_UNDER_TEST[name]
    model = tiny(name)
    out = model(batch())
    assert out["scores"].shape == (3, 5)
    out["scores"].sum().backward()
    assert model.visual.image_encoder.stages[0][0].weight.grad.abs().sum() > 0  # pixels reach the loss
    assert model.bert.embeddings.word_embeddings.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("name", sorted(MODELS_UNDER_TEST))
def test_region_features(name):
    model = tiny(name, feature_dim=6)
    assert model.visual.image_encoder is None
    b = batch(regions=True)
    scores = model(b)["scores"]
    assert scores.shape == (3, 5)
    b2 = {k: v.clone() for k, v in b.items()}
    b2["features"][0, 3] = 100.0  # a padded region must not matter
    torch.testing.assert_close(model(b2)["scores"], scores)
    with pytest.raises(UserError, match="feature_dim=6"):
        model({**b, "features": torch.randn(3, 4, 7)})
    with pytest.raises(UserError, match="no 'features'"):
        model(batch())
    with pytest.raises(UserError, match="no 'image'"):
        tiny(name)(b)


@pytest.mark.parametrize("name", sorted(MODELS_UNDER_TEST))
def test_no_batchnorm_batch_and_padding_independent(name):
    model = tiny(name).train()
    assert not [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    b = batch()
    full = model(b)["scores"]
    single = model({k: v[1:2] for k, v in b.items()})["scores"]
    torch.testing.assert_close(full[1:2], single, rtol=1e-4, atol=1e-5)
    short = {k: (v[:1, :6] if k in ("input_ids", "attention_mask", "token_type_ids") else v[:1]) for k, v in b.items()}
    torch.testing.assert_close(full[:1], model(short)["scores"], rtol=1e-4, atol=1e-5)


def test_mmbt_image_tokens_change_the_output():
    b = batch()
    one, four = tiny("mmbt"), tiny("mmbt", num_image_tokens=4)
    assert one(b)["scores"].shape == four(b)["scores"].shape == (3, 5)
    flipped = {**b, "image": b["image"].flip(-1)}  # the same pixels in another place
    assert not torch.allclose(four(b)["scores"], four(flipped)["scores"])


def test_pool_tokens_masked_groups():
    tokens = torch.arange(12, dtype=torch.float32).view(1, 6, 2)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
    pooled, pmask = pool_tokens(tokens, mask, 3)  # groups {0,1} {2,3} {4,5}
    torch.testing.assert_close(pooled[0], torch.tensor([[1.0, 2.0], [5.0, 6.0], [0.0, 0.0]]))
    assert pmask.tolist() == [[1, 1, 0]]
    mean, _ = pool_tokens(tokens, mask, 1)
    torch.testing.assert_close(mean[0, 0], torch.tensor([3.0, 4.0]))


@pytest.mark.parametrize("name", sorted(MODELS_UNDER_TEST))
def test_gradient_checkpointing_and_shard_units(name):
    b = batch()
    plain, ckpt = tiny(name).train(), tiny(name).train()
    ckpt.enable_gradient_checkpointing()
    assert all(layer.gradient_checkpointing for layer in ckpt.bert.encoder.layer)
    assert not any(layer.gradient_checkpointing for layer in plain.bert.encoder.layer)
    recomputed = []  # checkpointed image-encoder stages run again in backward
    ckpt.visual.image_encoder.stages[0].register_forward_pre_hook(lambda *_: recomputed.append(1))
    for model in (plain, ckpt):
        nn.functional.cross_entropy(model(b)["scores"], b["targets"]).backward()
    assert len(recomputed) == 2
    grads = [{n: p.grad for n, p in m.named_parameters() if p.grad is not None} for m in (plain, ckpt)]
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for key in grads[0]:
        torch.testing.assert_close(grads[0][key], grads[1][key], rtol=1e-4, atol=1e-6)
    units = tiny(name, num_hidden_layers=3).shard_units()
    assert len(units) == 3 and all(type(u).__name__ == "BertLayer" for u in units)


@pytest.mark.parametrize("name", sorted(MODELS_UNDER_TEST))
def test_user_errors(name):
    with pytest.raises(UserError, match=f"{name}.*vocab_size"):
        tiny(name, vocab_size=None)
    with pytest.raises(UserError, match=f"{name}.*num_labels"):
        tiny(name, num_labels=None)
    with pytest.raises(UserError, match="/nowhere/bert"):
        tiny(name, text_encoder={"pretrained_path": "/nowhere/bert"})


@pytest.mark.parametrize("name", sorted(MODELS_UNDER_TEST))
def test_minilm_init_equals_checkpoint(name):
    from safetensors.torch import load_file

    from mmvl.data.processors.text import BertTokenizerProcessor, minilm_dir

    tok = BertTokenizerProcessor(tokenizer_path="minilm", max_seq_length=16)
    model = tiny(name, vocab_size=tok.vocab_size, text_encoder={"pretrained_path": "minilm"})
    reference = load_file(str(minilm_dir() / "model.safetensors"))
    own = model.bert.state_dict()
    compared = [k for k in reference if k in own]
    assert len(compared) >= 100 and model.bert.config.hidden_size == 384
    for key in compared:
        torch.testing.assert_close(own[key], reference[key])
    texts = [tok("a red square"), tok("is this meme hateful or not?")]
    b = {k: nn.utils.rnn.pad_sequence([t[k] for t in texts], batch_first=True) for k in texts[0]}
    b["image"] = torch.randn(2, 3, 32, 32)
    assert model(b)["scores"].shape == (2, 5)
    with pytest.raises(UserError, match="vocab_size"):
        tiny(name, vocab_size=31, text_encoder={"pretrained_path": "minilm"})
