"""relation_network: objects carry their coordinates or boxes, batch and padding independence,
checkpointing, user errors, and training through mmvl_run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from mmvl.errors import UserError
from mmvl.models.modules.relation import PairwiseRelation, cell_coordinates, object_positions
from mmvl.models.relation_network import RelationNetwork
from mmvl.registry import MODELS

TINY_YAML = Path(__file__).parent / "tiny" / "relation_network.yaml"
RN_PROJECT = Path(__file__).parents[2] / "projects" / "relation_network" / "configs" / "sort_of_clevr" / "defaults.yaml"
TINY = {"vocab_size": 20, "num_labels": 5, "f_dropout": 0.0, "g_hidden_sizes": [16, 12], "f_hidden_sizes": [8],
        "question_encoder": {"word_dim": 6, "hidden_size": 10},
        "image_encoder": {"type": "cnn", "params": {"channels": [8, 8], "strides": [4, 4], "coords": False}}}


def tiny(**overrides) -> RelationNetwork:
    torch.manual_seed(0)
    return RelationNetwork(OmegaConf.create({**TINY, **overrides}))


def batch(n: int = 3) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 20, (n, 7), generator=g)
    mask = torch.ones_like(ids)
    ids[0, 5:], mask[0, 5:] = 0, 0  # one padded question
    return {"input_ids": ids, "attention_mask": mask, "image": torch.randn(n, 3, 32, 32, generator=g),
            "targets": torch.tensor([0, 1, 2, 3][:n])}


def test_registered_shapes_and_gradients():
    assert MODELS.get("relation_network") is RelationNetwork
    model = tiny()
    out = model(batch())
    assert out["scores"].shape == (3, 5)
    nn.functional.cross_entropy(out["scores"], batch()["targets"]).backward()
    for name in ("image_encoder.stages.0.0.weight", "word_embeddings.weight", "relation.left.weight",
                 "relation.question.weight", "f.0.weight"):
        assert model.get_parameter(name).grad.abs().sum() > 0, name  # every part reaches the loss


def test_objects_carry_their_cell_coordinates():
    model = tiny()
    objects = model.objects(batch())
    assert objects.shape == (3, 4, 8 + 2)  # 32 px / 16 = 2 x 2 cells, 8 channels + (x, y)
    torch.testing.assert_close(objects[1, :, -2:], cell_coordinates(2, 2, torch.device("cpu"), torch.float32))


def test_batch_and_padding_independent():
    model = tiny().eval()
    b = batch()
    full = model(b)["scores"]
    single = model({k: v[1:2] for k, v in b.items()})["scores"]
    torch.testing.assert_close(full[1:2], single, rtol=1e-4, atol=1e-5)
    short = {k: (v[:1, :5] if k in ("input_ids", "attention_mask") else v[:1]) for k, v in b.items()}
    torch.testing.assert_close(full[:1], model(short)["scores"], rtol=1e-4, atol=1e-5)  # padding is ignored


def test_gradient_checkpointing_gives_the_same_gradients():
    b = batch()
    plain, ckpt = tiny().train(), tiny().train()
    ckpt.enable_gradient_checkpointing()
    recomputed = []
    ckpt.relation.left.register_forward_pre_hook(lambda *_: recomputed.append(1))
    for model in (plain, ckpt):
        nn.functional.cross_entropy(model(b)["scores"], b["targets"]).backward()
    assert len(recomputed) == 2  # the pairs ran again in backward
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert [type(u) for u in ckpt.shard_units()] == [type(ckpt.image_encoder), PairwiseRelation]


def test_film_encoder_hears_the_question():
    model = tiny(image_encoder={"type": "film_cnn", "params": {"pixel_layer": False, "film_layers": [1],
                                                               "channels": [8, 8], "strides": [4, 4]}}).eval()
    assert model.image_encoder.cond_norm.normalized_shape == (10 + 6,)  # the LSTM state and the mean word embedding
    for film in model.image_encoder.layer_films.values():
        torch.nn.init.normal_(film.weight, std=0.5)
    b = batch()
    other = dict(b, input_ids=b["input_ids"].flip(1))
    assert not torch.allclose(model.objects(b), model.objects(other))  # same pixels, other question
    torch.testing.assert_close(model.objects(b), model.objects(b, model.encode_question(b)))


def test_user_errors():
    with pytest.raises(UserError, match="vocab_size"):
        tiny(vocab_size=None)
    with pytest.raises(UserError, match="num_labels"):
        tiny(num_labels=None)
    with pytest.raises(UserError, match="g_hidden_sizes"):
        PairwiseRelation(4, 3, [])
    with pytest.raises(UserError, match="no 'image'"):
        tiny()({k: v for k, v in batch().items() if k != "image"})


def test_tiny_config_trains_through_mmvl_run(tmp_path):
    from mmvl_cli.run import main

    assert main([f"config={TINY_YAML}", f"env.save_dir={tmp_path}/save", f"env.data_dir={tmp_path}/data"]) == 0
    events = [json.loads(line) for line in open(tmp_path / "save" / "metrics.jsonl")]
    train = [e["total_loss"] for e in events if e["split"] == "train"]
    assert len(train) == 2 and all(loss == loss for loss in train)
    val = [e for e in events if e["split"] == "val"][-1]
    assert {"accuracy/relational", "accuracy/count", "accuracy/prior/relational"} <= set(val)


def region_batch(n: int = 3, m: int = 4, dim: int = 7) -> dict:
    g = torch.Generator().manual_seed(2)
    b = batch(n)
    del b["image"]
    corners = torch.rand(n, m, 2, generator=g) * 0.5
    return dict(b, features=torch.rand(n, m, dim, generator=g), boxes=torch.cat([corners, corners + 0.3], -1),
                feature_mask=torch.ones(n, m, dtype=torch.long))


def test_regions_are_the_objects_and_padded_regions_join_no_pair():
    model = tiny(feature_dim=7, object_encoder_sizes=[9]).eval()
    assert model.image_encoder is None and model.shard_units() == [model.relation]
    b = region_batch()
    objects = model.objects(b)
    assert objects.shape == (3, 4, 7 + 5)  # features, then x1, y1, x2, y2 and the area
    torch.testing.assert_close(objects[..., 7:11], b["boxes"])
    scores = model(b)["scores"]
    padded = dict(b, features=torch.cat([b["features"], torch.randn(3, 2, 7)], 1),
                  boxes=torch.cat([b["boxes"], torch.rand(3, 2, 4)], 1),
                  feature_mask=torch.cat([b["feature_mask"], torch.zeros(3, 2, dtype=torch.long)], 1))
    torch.testing.assert_close(model(padded)["scores"], scores, rtol=1e-4, atol=1e-5)
    shuffled = dict(b, features=b["features"].flip(1), boxes=b["boxes"].flip(1))
    torch.testing.assert_close(model(shuffled)["scores"], scores, rtol=1e-4, atol=1e-5)  # a set, not a sequence
    with pytest.raises(UserError, match="feature_dim"):
        model(dict(b, features=torch.rand(3, 4, 5)))
    with pytest.raises(UserError, match="boxes"):
        model({k: v for k, v in b.items() if k != "boxes"})


def relational_losses(steps: int, tmp_path) -> tuple[float, float]:
    """Train the project config's relation_network over regions for ``steps`` updates on a small
    Sort-of-CLEVR; return the held-out cross-entropy on relational questions and that of the prior
    (each question type's training answer frequencies: the best a model blind to the image can do)."""
    from mmvl.build import build_datasets, build_model
    from mmvl.config import load_config
    from mmvl.data.sample import collate

    config = load_config([f"config={RN_PROJECT}", f"env.data_dir={tmp_path}", "training.seed=0",
                          "dataset_config.sort_of_clevr.num_images=600", "dataset_config.sort_of_clevr.num_val_images=60"])
    builder = build_datasets(config)["sort_of_clevr"]
    builder.prepare()
    train, val = builder.build("train"), builder.build("val")
    torch.manual_seed(0)
    model = build_model(config, {"sort_of_clevr": builder}).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(config.optimizer.params.lr))  # the project config's
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))
    for step in range(steps):
        rows = order[(step * 32) % len(train):][:32].tolist()
        batch = collate([train[i] for i in rows])
        loss = nn.functional.cross_entropy(model(batch)["scores"], batch["targets"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    counts = torch.ones(6, 10)  # add-one smoothing keeps the prior's loss finite
    for q in builder.questions("train"):
        counts[q["type"], q["answer"]] += 1
    prior = (counts / counts.sum(1, keepdim=True)).log()
    batch = collate([val[i] for i in range(len(val))])
    relational = batch["question_family"] == 1
    with torch.no_grad():
        scores = model.eval()(batch)["scores"][relational]
    targets, types = batch["targets"][relational], batch["question_type"][relational]
    model_loss = nn.functional.cross_entropy(scores, targets).item()
    prior_loss = -prior[types, targets].mean().item()
    return model_loss, prior_loss


# trains for ~25 s on 2 cores: with the slow tests (the fast suite ran 519-603 s of its 600)
@pytest.mark.slow
def test_relational_loss_falls_below_the_priors(tmp_path):
    model_loss, prior_loss = relational_losses(1200, tmp_path)
    assert model_loss < prior_loss - 0.05, (model_loss, prior_loss)


def test_question_attention_film_and_crop_encoder_options():
    crop = {"type": "cnn", "params": {"channels": [4, 6], "strides": [1, 2], "coords": False}}
    b = region_batch(dim=5 * 5 * 3)
    plain = tiny(feature_dim=75, object_encoder_sizes=[9])
    film = tiny(feature_dim=75, object_encoder_sizes=[9], object_encoder_film=True)
    film.load_state_dict(plain.state_dict(), strict=False)  # FiLM starts as the identity (gamma = beta = 0)
    torch.testing.assert_close(film.eval()(b)["scores"], plain.eval()(b)["scores"])
    attending = tiny(feature_dim=75, question_attention=16).eval()
    assert attending.attention["key"].out_features == 16
    scores = attending(b)["scores"]
    shuffled = dict(b, features=b["features"].flip(1), boxes=b["boxes"].flip(1))
    torch.testing.assert_close(attending(shuffled)["scores"], scores, rtol=1e-4, atol=1e-5)  # still a set
    cropped = tiny(feature_dim=75, crop_encoder=True, image_encoder=crop).eval()
    objects = cropped.objects(b)
    assert objects.shape == (3, 4, 6 + 5)  # the CNN's channels averaged over each 5x5 crop, then the box
    one = cropped.objects({k: v[:, :1] if k in ("features", "boxes", "feature_mask") else v for k, v in b.items()})
    torch.testing.assert_close(one[:, 0], objects[:, 0], rtol=1e-4, atol=1e-5)  # each crop on its own
    with pytest.raises(UserError, match="3 \\* side"):
        tiny(feature_dim=7, crop_encoder=True, image_encoder=crop)


def test_object_positions_are_box_centres_or_cell_coordinates():
    b = region_batch()
    model = tiny(feature_dim=7)
    centres = (b["boxes"][..., :2] + b["boxes"][..., 2:]) / 2 * 2 - 1  # [0, 1] corners -> [-1, 1] centre
    torch.testing.assert_close(object_positions(model.objects(b), regions=True), centres)
    cells = tiny().objects(batch())
    torch.testing.assert_close(object_positions(cells, regions=False),
                               cell_coordinates(2, 2, torch.device("cpu"), torch.float32).expand(3, -1, -1))


def test_pair_geometry_is_an_option_of_the_model():
    for kwargs in ({"feature_dim": 7}, {}):  # regions and feature-map cells
        model = tiny(pair_geometry=True, question_attention=True, **kwargs).eval()
        assert model.relation.geometry is not None
        b = region_batch() if kwargs else batch()
        scores = model(b)["scores"]
        assert torch.isfinite(scores).all()
    b = region_batch()
    model = tiny(feature_dim=7, pair_geometry=True).eval()
    shuffled = dict(b, features=b["features"].flip(1), boxes=b["boxes"].flip(1))
    torch.testing.assert_close(model(shuffled)["scores"], model(b)["scores"], rtol=1e-4, atol=1e-5)  # a set
    moved = dict(b, boxes=b["boxes"] + torch.tensor([0.2, 0.0, 0.2, 0.0]))
    assert not torch.allclose(model(moved)["scores"], model(b)["scores"])  # positions reach the answer
    assert tiny(feature_dim=7).relation.geometry is None  # off by default: the paper's model
    with pytest.raises(UserError, match="pair_geometry"):
        tiny(pair_geometry="yes")


def test_bag_of_words_question_is_a_linear_map_of_word_counts():
    model = tiny(question_encoder={"type": "bag_of_words", "hidden_size": 10}, question_attention=True).eval()
    assert not hasattr(model, "question_lstm") and model.attention["query"].in_features == 10
    b = batch()
    counts = torch.zeros(3, 20)
    for row in range(3):
        for token, real in zip(b["input_ids"][row].tolist(), b["attention_mask"][row].tolist()):
            counts[row, token] += real  # padded positions count nothing
    expected = counts @ model.bag_of_words.weight.T + model.bag_of_words.bias
    torch.testing.assert_close(model.encode_question(b), expected)
    torch.testing.assert_close(model.condition(b, expected), expected)  # attention reads q itself
    reordered = dict(b, input_ids=b["input_ids"][:, [1, 0, 2, 3, 4, 5, 6]])  # both positions real in every row
    torch.testing.assert_close(model(reordered)["scores"], model(b)["scores"])  # word order is lost, by design
    with pytest.raises(UserError, match="question_encoder.type"):
        tiny(question_encoder={"type": "gru"})


def test_pooled_first_equals_the_weighted_pairs_when_the_attention_is_one_hot():
    torch.manual_seed(0)
    pairs = PairwiseRelation(6, 4, [8, 5], geometry=True)
    pooled = PairwiseRelation(6, 4, [8, 5], geometry=True, pooled_first=True)
    pooled.load_state_dict(pairs.state_dict())
    objects, question, positions = torch.randn(2, 5, 6), torch.randn(2, 4), torch.rand(2, 5, 2) * 2 - 1
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    one_hot = nn.functional.one_hot(torch.tensor([3, 1]), 5).float()
    torch.testing.assert_close(pooled(objects, question, mask, one_hot, positions),
                               pairs(objects, question, mask, one_hot, positions))
    soft = torch.tensor([[0.5, 0.5, 0.0, 0.0, 0.0], [0.2, 0.8, 0.0, 0.0, 0.0]])
    assert not torch.allclose(pooled(objects, question, mask, soft, positions),
                              pairs(objects, question, mask, soft, positions))  # pooled before g, not after
    padded = dict(objects=objects.clone(), positions=positions.clone())
    padded["objects"][1, 3:] = 100.0  # padding joins no pair
    torch.testing.assert_close(pooled(padded["objects"], question, mask, one_hot, positions),
                               pooled(objects, question, mask, one_hot, positions))


def test_pooled_first_is_an_option_of_the_model():
    for kwargs in ({"feature_dim": 7}, {}):  # regions and feature-map cells
        model = tiny(question_attention=True, pooled_first=True, pair_geometry=True, **kwargs).eval()
        assert model.relation.pooled_first
        b = region_batch() if kwargs else batch()
        scores = model(b)["scores"]
        assert scores.shape == (3, 5) and torch.isfinite(scores).all()
    b = region_batch()
    model = tiny(feature_dim=7, question_attention=True, pooled_first=True).eval()
    shuffled = dict(b, features=b["features"].flip(1), boxes=b["boxes"].flip(1))
    torch.testing.assert_close(model(shuffled)["scores"], model(b)["scores"], rtol=1e-4, atol=1e-5)  # a set
    for bad in ({"pooled_first": True}, {"pooled_first": "yes", "question_attention": True}):
        with pytest.raises(UserError, match="pooled_first"):
            tiny(**bad)


def test_film_on_the_attention_keys_leaves_the_pairs_unconditioned():
    model = tiny(object_encoder_sizes=[9], object_encoder_film=True, film_keys_only=True,
                 question_attention=True).eval()
    with torch.no_grad():  # FiLM starts as the identity; give it a real effect
        for film in model.object_encoder.films:
            film.weight.normal_()
    seen = {}
    model.relation.register_forward_hook(lambda module, args, out: seen.update(objects=args[0]))
    model.attention["key"].register_forward_hook(lambda module, args, out: seen.update(keys=args[0]))
    b = batch()
    model(b)
    raw = model.objects(b)
    cond = model.condition(b, model.encode_question(b))
    torch.testing.assert_close(seen["objects"], model.object_encoder(raw, None))  # the pairs: no FiLM
    torch.testing.assert_close(seen["keys"], model.object_encoder(raw, cond))  # the attention: FiLM-ed
    assert not torch.allclose(seen["keys"], seen["objects"])
    for bad in ({"film_keys_only": True, "question_attention": True},
                {"film_keys_only": True, "object_encoder_film": True},
                {"film_keys_only": "yes", "object_encoder_film": True, "question_attention": True}):
        with pytest.raises(UserError, match="film_keys_only"):
            tiny(object_encoder_sizes=[9], **bad)


def test_the_easy_vqa_project_normalises_each_cnn_channel_on_its_own():
    """projects/relation_network/configs/easy_vqa: one GroupNorm group per CNN channel (what made shape
    learning seed-robust there, docs/easy_vqa.md) reaches the built model."""
    from mmvl.config import load_config

    project = RN_PROJECT.parents[1] / "easy_vqa" / "defaults.yaml"
    config = load_config([f"config={project}", "model_config.relation_network.vocab_size=30",
                          "model_config.relation_network.num_labels=13"])
    model = RelationNetwork(config.model_config.relation_network)
    norms = [m for m in model.image_encoder.modules() if isinstance(m, nn.GroupNorm)]
    assert len(norms) == 3 and all(n.num_groups == n.num_channels == 24 for n in norms)
