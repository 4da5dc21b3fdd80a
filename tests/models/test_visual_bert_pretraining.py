"""visual_bert with region features + boxes, and its pretraining heads (masked LM + image-text matching):
shapes and gradients, padding invariance, box positions, tied MLM decoder, losses that go down,
gradient checkpointing, user errors, and a few mmvl_run updates on the tiny coco_captions fixture."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from mmvl.errors import UserError
from mmvl.models import VisualBert

ROOT = Path(__file__).resolve().parents[2]
TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "vocab_size": 20, "num_labels": 7,
        "max_position_embeddings": 32, "image_encoder": {"type": "cnn", "params": {"channels": [8, 16],
                                                                                   "strides": [4, 4]}}}
PRETRAIN = {"training_head_type": "pretraining", "losses": []}


def tiny(**overrides) -> VisualBert:
    torch.manual_seed(0)
    return VisualBert(OmegaConf.create({**TINY, **overrides}))


def batch(n: int = 3, regions: bool = True, labels: bool = False) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 20, (n, 9), generator=g)
    ids[:, 0], ids[:, -1] = 2, 3
    mask = torch.ones_like(ids)
    ids[0, 6:], mask[0, 6:] = 0, 0
    out = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids),
           "targets": torch.tensor([0, 1, 1, 0][:n])}
    if regions:
        out["features"] = torch.randn(n, 4, 6, generator=g)
        xy = torch.rand(n, 4, 2, generator=g) * 0.5
        out["boxes"] = torch.cat([xy, xy + 0.1 + torch.rand(n, 4, 2, generator=g) * 0.4], dim=-1)
        out["feature_mask"] = torch.tensor([[1, 1, 1, 0]] + [[1, 1, 1, 1]] * (n - 1))
    else:
        out["image"] = torch.randn(n, 3, 32, 32, generator=g)
    if labels:
        lm = torch.full_like(ids, -100)
        lm[:, 2], lm[1:, 7] = ids[:, 2], ids[1:, 7]
        out["lm_label_ids"] = lm
    return out


# -- region features ----------------------------------------------------------------------------------
def test_regions_forward_backward():
    model = tiny(feature_dim=6)
    assert model.image_encoder is None and not hasattr(model, "visual_embeddings")
    out = model(batch())
    assert out["scores"].shape == (3, 7)
    out["scores"].sum().backward()
    emb = model.region_embeddings
    assert emb.proj.weight.grad.abs().sum() > 0 and emb.box.weight.grad.abs().sum() > 0
    assert model.bert.embeddings.word_embeddings.weight.grad.abs().sum() > 0


def test_padded_regions_do_not_change_scores():
    model = tiny(feature_dim=6).eval()
    b = batch()
    scores = model(b)["scores"]
    noisy = dict(b, features=b["features"].clone(), boxes=b["boxes"].clone())
    noisy["features"][0, 3], noisy["boxes"][0, 3] = 100.0, 0.9  # the padded region of sample 0
    torch.testing.assert_close(model(noisy)["scores"], scores)
    unpadded = {k: (v[:1, :3] if k in ("features", "boxes", "feature_mask") else v[:1]) for k, v in b.items()}
    torch.testing.assert_close(model(unpadded)["scores"], scores[:1], rtol=1e-4, atol=1e-5)
    short_text = {k: (v[:, :6] if k in ("input_ids", "attention_mask", "token_type_ids") else v)
                  for k, v in unpadded.items()}
    torch.testing.assert_close(model(short_text)["scores"], scores[:1], rtol=1e-4, atol=1e-5)


def test_box_coordinates_change_the_output():
    model = tiny(feature_dim=6).eval()
    b = batch()
    scores = model(b)["scores"]
    moved = dict(b, boxes=b["boxes"].flip(-1))  # same regions, other places
    assert not torch.allclose(model(moved)["scores"], scores)
    assert not torch.allclose(model({k: v for k, v in b.items() if k != "boxes"})["scores"], scores)


def test_region_user_errors():
    model = tiny(feature_dim=6)
    with pytest.raises(UserError, match="feature_dim is set but the batch has no 'features'"):
        model(batch(regions=False))
    with pytest.raises(UserError, match="feature_dim=7"):
        model(dict(batch(), features=torch.randn(3, 4, 7)))
    with pytest.raises(UserError, match="no 'image'.*feature_dim"):
        tiny()(batch())
    with pytest.raises(UserError, match="classifier_input"):
        tiny(feature_dim=6, classifier_input="pooled_and_visual")


# -- pretraining heads ---------------------------------------------------------------------------------
@pytest.mark.parametrize("regions", [True, False])
def test_pretraining_returns_both_losses_and_matching_scores(regions):
    model = tiny(feature_dim=6 if regions else None, num_labels=None, **PRETRAIN).train()
    assert not hasattr(model, "classifier")
    out = model(batch(regions=regions, labels=True))
    assert out["scores"].shape == (3, 2) and set(out["losses"]) == {"mlm", "itm"}
    assert all(v.dim() == 0 and torch.isfinite(v) for v in out["losses"].values())
    sum(out["losses"].values()).backward()
    assert model.heads.mlm.bias.grad.abs().sum() > 0 and model.heads.itm.weight.grad.abs().sum() > 0
    # the decoder is the word-embedding matrix itself, not a copy
    assert not any(p.shape == model.bert.embeddings.word_embeddings.weight.shape
                   for n, p in model.named_parameters() if n.startswith("heads."))


def test_mlm_loss_is_plain_cross_entropy_over_selected_tokens():
    model = tiny(feature_dim=6, **PRETRAIN).eval()
    b = batch(labels=True)
    loss = model(b)["losses"]["mlm"]
    captured = {}
    model.bert.encoder.register_forward_hook(lambda m, i, o: captured.update(h=o[0]))  # returns None
    model(b)
    text = captured["h"][:, : b["input_ids"].shape[1]]
    logits = model.heads.mlm(text, model.bert.embeddings.word_embeddings.weight)
    expected = nn.functional.cross_entropy(logits.flatten(0, 1), b["lm_label_ids"].flatten(), ignore_index=-100)
    torch.testing.assert_close(loss, expected)
    nothing = dict(b, lm_label_ids=torch.full_like(b["input_ids"], -100))
    assert model(nothing)["losses"]["mlm"].item() == 0.0  # a batch without selected tokens: 0, not NaN


def test_pretraining_user_errors_and_evaluation_without_labels():
    model = tiny(feature_dim=6, **PRETRAIN)
    with pytest.raises(UserError, match="lm_label_ids.*mask_probability"):
        model.train()(batch())
    with pytest.raises(UserError, match="targets"):
        model.train()({k: v for k, v in batch(labels=True).items() if k != "targets"})
    out = model.eval()(batch())  # unmasked validation data: matching scores and loss only
    assert set(out["losses"]) == {"itm"} and out["scores"].shape == (3, 2)
    with pytest.raises(UserError, match="losses: \\[\\]"):
        tiny(training_head_type="pretraining", losses=[{"type": "cross_entropy"}])  # ITM counted twice
    with pytest.raises(UserError, match="training_head_type"):
        tiny(training_head_type="pretrain")


@pytest.mark.parametrize("regions", [True, False])
def test_gradient_checkpointing_same_gradients(regions):
    b = batch(regions=regions, labels=True)
    kw = dict(feature_dim=6 if regions else None, **PRETRAIN)
    plain, ckpt = tiny(**kw).train(), tiny(**kw).train()
    ckpt.enable_gradient_checkpointing()
    assert all(layer.gradient_checkpointing for layer in ckpt.bert.encoder.layer)
    grads = []
    for model in (plain, ckpt):
        sum(model(b)["losses"].values()).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 20
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-6)


# -- the tiny coco_captions fixture ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def coco(tmp_path_factory):
    """``(data_dir, vocab.txt, region-feature LMDB)`` for the fixture's COCO captions."""
    from mmvl.data.features.lmdb_store import LMDBFeatureWriter
    from mmvl.data.processors.text import write_word_vocab
    from tests.fixtures.vl_data import write_coco_captions

    root = tmp_path_factory.mktemp("coco_pretrain")
    write_coco_captions(root)
    captions, images = [], []
    for split in ("train2014", "val2014"):
        doc = json.loads((root / "coco" / "annotations" / f"captions_{split}.json").read_text())
        captions += [a["caption"] for a in doc["annotations"]]
        images += doc["images"]
    vocab = write_word_vocab(captions, root / "vocab.txt")
    g = torch.Generator().manual_seed(0)
    with LMDBFeatureWriter(root / "regions.lmdb", map_size=1 << 20) as writer:
        for k, image in enumerate(images):  # 3-5 regions an image, boxes in pixels
            n, w, h = 3 + k % 3, image["width"], image["height"]
            xy = torch.rand(n, 2, generator=g) * torch.tensor([w / 2, h / 2])
            boxes = torch.cat([xy, xy + torch.tensor([w / 2, h / 2])], dim=1)
            writer.put(Path(image["file_name"]).stem, torch.randn(n, 6, generator=g).numpy(),
                       boxes.numpy(), w, h)
    lmdb = root / "regions.lmdb"
    return root, vocab, lmdb


def test_pretraining_losses_go_down_on_a_coco_batch(coco):
    import mmvl.data.datasets.coco_captions  # noqa: F401  (registers coco_captions)
    from mmvl.registry import DATASETS

    data_dir, vocab, _ = coco
    cfg = OmegaConf.load(ROOT / "configs/datasets/coco_captions.yaml").dataset_config.coco_captions
    cfg = OmegaConf.merge(cfg, {"image_size": 32, "mask_probability": 0.3, "processors": {"text_processor": {
        "type": "bert_tokenizer", "params": {"tokenizer_path": str(vocab), "max_seq_length": 16}}}})
    builder = DATASETS.get("coco_captions")(cfg, str(data_dir))
    train = builder.build("train")
    b = builder.collate([train[i] for i in range(len(train))])
    assert b["lm_label_ids"].ne(-100).sum() >= 4 and set(b["targets"].tolist()) == {0, 1}
    model = tiny(vocab_size=builder.model_info()["vocab_size"], **PRETRAIN).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    totals, mlm = [], []
    for _ in range(20):
        losses = model(b)["losses"]
        total = losses["mlm"] + losses["itm"]
        optimizer.zero_grad()
        total.backward()
        optimizer.step()
        totals.append(total.item())
        mlm.append(losses["mlm"].item())
    assert totals[-1] < 0.75 * totals[0] and mlm[-1] < 0.75 * mlm[0], totals  # measured: 3.49 -> 2.08


@pytest.mark.parametrize("visual", ["images", "regions_checkpointed"])
def test_mmvl_run_pretrains_on_coco_captions(visual, coco, tmp_path):
    from mmvl.config import load_config
    from mmvl.trainers import run

    data_dir, vocab, lmdb = coco
    opts = [f"config={ROOT / 'projects/visual_bert/configs/coco_captions/pretrain.yaml'}",
            f"env.data_dir={data_dir}", f"env.save_dir={tmp_path}", "training.max_updates=4",
            "training.batch_size=4", "training.num_workers=0", "training.progress_bar=false",
            "training.log_interval=1", "training.evaluation_interval=4", "scheduler.params.num_warmup_steps=1",
            "model_config.visual_bert.text_encoder.pretrained_path=null",
            "dataset_config.coco_captions.image_size=32", "dataset_config.coco_captions.mask_eval=true",
            f"dataset_config.coco_captions.processors.text_processor.params.tokenizer_path={vocab}"]
    opts += [f"model_config.visual_bert.{k}={v}" for k, v in TINY.items()
             if k not in ("vocab_size", "num_labels", "image_encoder")]
    opts.append("model_config.visual_bert.image_encoder={type: cnn, params: {channels: [8, 16], strides: [4, 4]}}")
    if visual == "regions_checkpointed":
        opts += ["model_config.visual_bert.feature_dim=6", "training.gradient_checkpointing=true",
                 f"dataset_config.coco_captions.processors.features={{type: features, params: {{path: {lmdb}, "
                 "max_features: null}}"]
    torch.manual_seed(0)
    results = run(load_config(opts))
    assert results["updates"] == 4
    events = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    train = [e for e in events if e["split"] == "train"]
    assert [e["update"] for e in train] == [1, 2, 3, 4]
    for e in train:
        assert math.isfinite(e["mlm"]) and math.isfinite(e["itm"])
        assert e["total_loss"] == pytest.approx(e["mlm"] + e["itm"], rel=1e-4)
    val = results["val"]["coco_captions"]
    assert {"accuracy", "roc_auc"} <= set(val) and math.isfinite(val["accuracy"])
    # the model's own losses are evaluated too (means over the split), not only the configured ones
    assert val["mlm"] > 0 and val["itm"] > 0 and val["total_loss"] == pytest.approx(val["mlm"] + val["itm"])
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
