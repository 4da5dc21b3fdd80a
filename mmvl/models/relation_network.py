"""Relation Network (Santoro et al., 2017): the CNN + RN baseline for relational VQA.

Every cell of a CNN's feature map, with its (x, y) coordinates appended, is an
"object". Every ordered pair of objects, with the question's embedding (the
last state of an LSTM over the words), goes through the MLP ``g``; the pair
outputs are summed and the MLP ``f`` scores the answers:

    scores = f( sum_{i,j} g([o_i; o_j; q]) )

Options beyond the paper (all off by default): an MLP over each object before the pairs
(``object_encoder_sizes``), FiLM-ed by the question (``object_encoder_film``); an image
encoder over each region's pixel crop (``crop_encoder``); the question's attention over the
objects weighting each pair by its first object (``question_attention``); the pair's geometry
(both positions, their offset and distance) added to g's first layer (``pair_geometry``); a
bag-of-words question vector instead of the LSTM (``question_encoder.type: bag_of_words``);
the attended object pooled into every pair's first (``pooled_first``: N pairs, not N^2); the
FiLM on the attention's keys only (``film_keys_only``).
The Sort-of-CLEVR demo uses the question attention, pair geometry and bag-of-words over object
regions; ``pixels.yaml`` adds the FiLM and the last two over CNN cells. docs/sort_of_clevr.md's model
zoo shows what each one changed.

With ``feature_dim`` set the objects are region features with their boxes instead
(``batch["features"]``, ``boxes``, ``feature_mask``; padded regions join no pair): the
paper's state-description setting, where the objects are given rather than found.

Nothing in it is specific to a task: the sum over all pairs is what lets it
compare any two things in the image, which single-stream transformers have to
discover through attention.

Cost: an H x W map gives (HW)^2 pairs, each through every layer of ``g`` (a 5x5
map: 625 pairs per question). ``g``'s first layer is linear in the
concatenation, so it is computed as ``W_a o_i + W_b o_j + W_q q`` from per-cell
and per-question products (HW + 1 instead of (HW)^2 matrix rows); the layers
after it run on all pairs and set the cost (``g_hidden_sizes``).
"""
from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from mmvl.errors import UserError
from mmvl.models.base import BaseModel
from mmvl.models.modules.bert import plain_config, require_num_labels
from mmvl.models.modules.image_encoders import build_image_encoder
from mmvl.models.modules.relation import ObjectEncoder, PairwiseRelation, cell_coordinates, object_positions
from mmvl.models.modules.visual_tokens import BOX_DIM, region_inputs, require_image
from mmvl.registry import register_model


#: ``question_encoder.type`` values: an LSTM's last state (the paper) or a linear map of word counts
QUESTION_ENCODERS = ("lstm", "bag_of_words")


def crop_side(feature_dim: int) -> int:
    """The side of the square RGB crops that ``feature_dim`` flattens (side * side * 3)."""
    side = round((feature_dim / 3) ** 0.5)
    if side * side * 3 != feature_dim:
        raise UserError(f"relation_network: crop_encoder reads the region features as square RGB crops, but "
                        f"feature_dim={feature_dim} is not 3 * side^2; set crop_encoder: false.")
    return side


def classifier(width: int, hidden: list[int], dropout: float, num_labels: int) -> nn.Sequential:
    """f: ReLU layers of ``hidden`` widths over the pooled relations, dropout, then the scores."""
    layers: list[nn.Module] = []
    for size in hidden:
        layers += [nn.Linear(width, size), nn.ReLU(inplace=True)]
        width = size
    return nn.Sequential(*layers, nn.Dropout(dropout), nn.Linear(width, num_labels))


@register_model("relation_network")
class RelationNetwork(BaseModel):
    """CNN cells + coordinates -> all pairs with the question through g, summed -> f -> scores."""

    config_path = "models/relation_network.yaml"
    PARTS = {"text_encoder": ("word_embeddings", "question_lstm", "bag_of_words"), "image_encoder": ("image_encoder",),
             "object_encoder": ("object_encoder",), "attention": ("attention",), "relation": ("relation",),
             "classifier": ("f",)}
    HEAD = ("f",)

    def __init__(self, config: DictConfig):
        super().__init__(config)
        cfg = plain_config(config)
        num_labels = require_num_labels(cfg, "relation_network")
        if cfg.get("vocab_size") is None:
            raise UserError("relation_network: model_config.relation_network.vocab_size is null and no dataset "
                            "filled it in; set it or use a dataset with a text processor.")
        q = dict(cfg.get("question_encoder") or {})
        word_dim, question_dim = int(q.get("word_dim", 32)), int(q.get("hidden_size", 128))
        self.question_type = str(q.get("type", "lstm"))
        if self.question_type not in QUESTION_ENCODERS:
            raise UserError(f"relation_network: question_encoder.type={self.question_type!r}; use one of "
                            f"{', '.join(QUESTION_ENCODERS)}.")
        # what FiLM layers and the question attention read (see condition())
        cond_dim = question_dim + word_dim if self.question_type == "lstm" else question_dim
        self.feature_dim = int(cfg["feature_dim"]) if cfg.get("feature_dim") else None
        self.crop_side = crop_side(self.feature_dim) if self.feature_dim and cfg.get("crop_encoder") else None
        self.image_encoder: nn.Module | None = None
        if self.feature_dim and not self.crop_side:  # region features + box features are the objects
            object_dim = self.feature_dim + BOX_DIM
        else:
            encoder_spec = dict(cfg.get("image_encoder") or {"type": "cnn"})
            if encoder_spec.get("type") == "film_cnn":  # conditioned on the question (see condition())
                encoder_spec["params"] = {**dict(encoder_spec.get("params") or {}), "cond_dim": cond_dim}
            self.image_encoder = build_image_encoder(encoder_spec)
            object_dim = int(self.image_encoder.out_dim) + (BOX_DIM if self.crop_side else 2)
        self.vocab_size = int(cfg["vocab_size"])
        self._question_layers(word_dim, question_dim, float(q.get("forget_bias", 0.0)))
        film, keys_only = cfg.get("object_encoder_film", False), cfg.get("film_keys_only", False)
        if not isinstance(keys_only, bool) or (keys_only and not (film and cfg.get("question_attention"))):
            raise UserError(f"relation_network: film_keys_only={keys_only!r}; use true (with object_encoder_film "
                            "and question_attention) or false.")
        self.film_keys_only = keys_only
        self.object_encoder = ObjectEncoder(object_dim, [int(w) for w in cfg.get("object_encoder_sizes") or []],
                                            cond_dim if film else None)
        object_dim = self.object_encoder.out_dim
        self.attention: nn.ModuleDict | None = None
        if cfg.get("question_attention"):  # bilinear question-object scores (see forward)
            width = cfg["question_attention"]
            if not isinstance(width, int) or width < 1:
                raise UserError(f"relation_network: question_attention={width!r}; use false, true or a width (e.g. 64).")
            width = 64 if width is True else width
            self.attention = nn.ModuleDict({"query": nn.Linear(cond_dim, width), "key": nn.Linear(object_dim, width)})
        geometry = cfg.get("pair_geometry", False)
        if not isinstance(geometry, bool):
            raise UserError(f"relation_network: pair_geometry={geometry!r}; use true or false.")
        pooled = cfg.get("pooled_first", False)
        if not isinstance(pooled, bool) or (pooled and self.attention is None):
            raise UserError(f"relation_network: pooled_first={pooled!r}; use true (with question_attention) or false.")
        self.relation = PairwiseRelation(object_dim, question_dim,
                                         [int(w) for w in cfg.get("g_hidden_sizes") or [256, 256, 256, 256]],
                                         str(cfg.get("pair_reduction") or "sum"), geometry, pooled)
        self.f = classifier(self.relation.out_dim, [int(w) for w in cfg.get("f_hidden_sizes") or [256, 256]],
                            float(cfg.get("f_dropout", 0.5)), num_labels)

    def _question_layers(self, word_dim: int, question_dim: int, forget_bias: float) -> None:
        """The question encoder's layers: a linear map of word counts, or embeddings and an LSTM."""
        if self.question_type == "bag_of_words":
            self.bag_of_words = nn.Linear(self.vocab_size, question_dim)
            return
        self.word_embeddings = nn.Embedding(self.vocab_size, word_dim, padding_idx=0)
        self.question_lstm = nn.LSTM(word_dim, question_dim, batch_first=True)
        with torch.no_grad():  # gates i, f, g, o: a forget bias keeps early words (the colour) in the last state
            self.question_lstm.bias_ih_l0[question_dim:2 * question_dim] += forget_bias

    def encode_question(self, batch: dict[str, Any]) -> torch.Tensor:
        """The LSTM state after the last real token (padding after it cannot change it), or a linear
        map of the question's word counts (``bag_of_words``)."""
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        if self.question_type == "bag_of_words":
            real = torch.ones_like(ids) if mask is None else mask
            counts = torch.zeros(ids.shape[0], self.vocab_size, device=ids.device, dtype=self.bag_of_words.weight.dtype)
            return self.bag_of_words(counts.scatter_add_(1, ids, real.to(counts.dtype)))
        outputs, _ = self.question_lstm(self.word_embeddings(ids))
        if mask is None:
            return outputs[:, -1]
        last = (mask.long().sum(1) - 1).clamp(min=0)
        return outputs.gather(1, last.view(-1, 1, 1).expand(-1, 1, outputs.shape[-1])).squeeze(1)

    def condition(self, batch: dict[str, Any], question: torch.Tensor) -> torch.Tensor:
        """What FiLM layers and the question attention read: the LSTM state and the mean word
        embedding (every word, the colour included, one linear step away, however far from the end
        of the question it stands); with ``bag_of_words`` the question vector itself."""
        if self.question_type == "bag_of_words":  # every word is already one linear step away
            return question
        words = self.word_embeddings(batch["input_ids"])
        mask = batch.get("attention_mask")
        m = (torch.ones_like(batch["input_ids"]) if mask is None else mask).unsqueeze(-1).to(words.dtype)
        return torch.cat([question, (words * m).sum(1) / m.sum(1).clamp(min=1)], dim=-1)

    def objects(self, batch: dict[str, Any], question: torch.Tensor | None = None) -> torch.Tensor:
        """``B x HW x (C + 2)``: the feature-map cells with their coordinates appended; with
        ``feature_dim`` set, ``B x M x (F + 5)``: each region's features (or, with ``crop_encoder``,
        the image encoder's mean over the region's pixels, C wide) with its box features.

        A question-conditioned encoder (``film_cnn``) also gets the question (:meth:`condition`).
        """
        if self.feature_dim:
            feats, _, boxes = region_inputs(batch, int(self.feature_dim), "relation_network")
            if boxes is None:
                raise UserError("relation_network: region features need their boxes (batch['boxes']): the boxes "
                                "are the objects' positions.")
            if self.crop_side:
                b, m, _ = feats.shape
                crops = feats.view(b * m, self.crop_side, self.crop_side, 3).permute(0, 3, 1, 2)
                cond = self._condition_of(batch, question)
                grid = self._encode(crops, None if cond is None else cond.repeat_interleave(m, dim=0))
                feats = grid.mean(dim=(2, 3)).view(b, m, -1)
            return torch.cat([feats, boxes], dim=-1)
        image = require_image(batch, "relation_network")
        grid = self._encode(image, self._condition_of(batch, question))
        b, _, h, w = grid.shape
        cells = grid.flatten(2).transpose(1, 2)
        coords = cell_coordinates(h, w, cells.device, cells.dtype).expand(b, -1, -1)
        return torch.cat([cells, coords], dim=-1)

    def _condition_of(self, batch: dict[str, Any], question: torch.Tensor | None) -> torch.Tensor | None:
        if not getattr(self.image_encoder, "conditioned", False):
            return None
        return self.condition(batch, self.encode_question(batch) if question is None else question)

    def _encode(self, images: torch.Tensor, cond: torch.Tensor | None) -> torch.Tensor:
        return self.image_encoder(images) if cond is None else self.image_encoder(images, cond)

    def forward(self, batch: dict[str, Any]) -> dict[str, Any]:
        question = self.encode_question(batch)
        cond = self.condition(batch, question) if len(self.object_encoder.films) or self.attention else None
        raw = self.objects(batch, question)
        positions = object_positions(raw, bool(self.feature_dim)) if self.relation.geometry is not None else None
        objects = self.object_encoder(raw, question if cond is None else cond)
        keyed = objects
        if self.film_keys_only:  # FiLM-ed objects are the attention's keys; the pairs see the objects
            objects = self.object_encoder(raw, None)  # unconditioned (a FiLM marking the named one erased the rest)
        mask = batch.get("feature_mask") if self.feature_dim else None
        first = None
        if self.attention is not None:  # softmax over the real objects of query(q) . key(o_i)
            # Not divided by sqrt(width): with that temperature the softmax starts near uniform, every
            # object is every pair's first, and finding the named object (which every question type
            # needs) came 1,000-2,000 updates later on Sort-of-CLEVR regions, at a seed-dependent update.
            query, keys = self.attention["query"](cond.to(objects.dtype)), self.attention["key"](keyed)
            scores = (keys @ query.unsqueeze(-1)).squeeze(-1)
            if mask is not None:
                scores = scores.masked_fill(mask == 0, torch.finfo(scores.dtype).min)
            first = scores.softmax(dim=-1)
        relation = self.relation(objects, question.to(objects.dtype), mask, first, positions)
        return {"scores": self.f(relation)}

    def enable_gradient_checkpointing(self) -> None:
        if self.image_encoder is not None:
            self.image_encoder.enable_gradient_checkpointing()
        self.relation.checkpointing = True

    def shard_units(self) -> list[nn.Module]:
        return [m for m in (self.image_encoder, self.relation) if m is not None]
