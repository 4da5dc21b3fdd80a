"""COCO Captions as image-text matching (ITM): does this caption describe this image?

Reads the official ``captions_<split>2014.json`` (``{"images": [{"id", "file_name",
...}], "annotations": [{"id", "image_id", "caption"}]}``). Item ``i`` is
annotation ``i``'s image with its own caption (``targets`` 1) or, with
probability ``negative_ratio``, a caption of another image (``targets`` 0). The
choice depends only on ``seed``, the split and ``i``, so every epoch, worker
count and rank sees the same pairs and evaluation is repeatable.

``mask_probability`` > 0 asks the text processor for masked-LM inputs and
``lm_label_ids`` (``bert_tokenizer`` masks; a processor without masking, such
as ``vocab``, gets a warning and no masking). Masking is drawn from
``(seed, split, index, epoch)``, so it changes every epoch but never depends on
the worker or rank, and it is applied to the train split only unless
``mask_eval: true``.

A parsed split is two tables (:mod:`mmvl.data.records`): ``records`` (``id``,
``image_id``, ``caption`` and ``image``, the row of its image) and ``images``
(``id``, ``file_name``).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from mmvl.data.datasets._common import FileDatasetBuilder, ImageLoading, int_id, require_fields, stream_json
from mmvl.data.records import Strings, Table
from mmvl.data.processors import image as _image  # noqa: F401  (registers torchvision_transforms)
from mmvl.data.processors import text as _text  # noqa: F401  (registers bert_tokenizer)
from mmvl.data.processors import vocab as _vocab  # noqa: F401  (registers vocab)
from mmvl.config.components import accepts
from mmvl.errors import UserError
from mmvl.registry import PROCESSORS, register_dataset

log = logging.getLogger("mmvl")
_SPLIT_SALT = {"train": 0, "val": 1, "test": 2}


class COCOMatchingDataset(ImageLoading, Dataset):
    """Items: ``id`` (annotation id), ``image_id``, ``caption_id``, tokens, ``image``/features, ``targets``."""

    dataset = "coco_captions"

    def __init__(self, records: Table, file_names: Strings, images: Path, text_processor: Any,
                 image_processor: Any, features_processor: Any, policy: str, negative_ratio: float, seed: int,
                 salt: int, mask: bool = False):
        self.records, self.file_names, self.images = records, file_names, images
        self.ids, self.image_ids = records.column("id"), records.column("image_id")
        self.captions, self.image_rows = records.column("caption"), records.column("image")
        self.text_processor, self.image_processor = text_processor, image_processor
        self.features_processor, self.policy = features_processor, policy
        self.negative_ratio, self.seed, self.salt = float(negative_ratio), int(seed), int(salt)
        self.mask, self.epoch = bool(mask), 0

    def set_epoch(self, epoch: int) -> None:
        """Called by the train loader before each epoch: masking differs between epochs."""
        self.epoch = int(epoch)

    def image_path(self, row: int) -> Path:
        return self.images / self.file_names[int(self.image_rows[row])]

    def partner(self, index: int) -> int:
        """``index`` itself (a match) or a deterministic caption of another image (a mismatch)."""
        if self.negative_ratio <= 0:
            return index
        rng = np.random.default_rng([self.seed, self.salt, index])
        if rng.random() >= self.negative_ratio:
            return index
        image_id, n = self.image_ids[index], len(self.records)
        j = int(rng.integers(n))
        for step in range(n):  # the first caption of another image at or after j
            k = (j + step) % n
            if self.image_ids[k] != image_id:
                return k
        return index  # a single image: no negative exists (the builder refuses this case)

    def make_item(self, index: int) -> dict[str, Any] | None:
        visual = self.visual_inputs(index)
        if visual is None:
            return None
        other = self.partner(index)
        item: dict[str, Any] = {"id": int(self.ids[index]), "image_id": int(self.image_ids[index]),
                                "caption_id": int(self.ids[other])}
        caption = self.captions[other]
        if self.mask:  # the stream id 1 keeps masking draws apart from partner()'s
            item.update(self.text_processor(caption, rng=[self.seed, self.salt, index, self.epoch, 1]))
        else:
            item.update(self.text_processor(caption))
        item.update(visual)
        item["targets"] = int(self.image_ids[other] == self.image_ids[index])
        return item


@register_dataset("coco_captions")
class COCOCaptionsBuilder(FileDatasetBuilder):
    """COCO captions turned into a binary matching task (``num_labels`` 2)."""

    name = "coco_captions"
    config_path = "datasets/coco_captions.yaml"

    def source_files(self, split: str) -> list[Path]:
        return [self.split_file(split, "annotations", "the captions JSON file")]

    def load_records(self, split: str) -> dict[str, Table]:
        path = self.source_files(split)[0]
        rows: dict[int, int] = {}  # image id -> row in the images table
        files: list[str] = []
        ids, image_ids, image_rows, captions = [], [], [], []
        for key, i, item in stream_json(path, ("images", "annotations"), self.name, "captions file"):
            if key == "images":
                require_fields(item, ("id", "file_name"), path, self.name, f"images[{i}]")
                rows.setdefault(int_id(item["id"], path, self.name, f"images[{i}].id"), len(files))
                files.append(str(item["file_name"]))
                continue
            require_fields(item, ("id", "image_id", "caption"), path, self.name, f"annotations[{i}]")
            ids.append(int_id(item["id"], path, self.name, f"annotations[{i}].id"))
            image_ids.append(int_id(item["image_id"], path, self.name, f"annotations[{i}].image_id"))
            captions.append(str(item["caption"]))
        for i, image_id in enumerate(image_ids):  # images may come after annotations in the file
            if image_id not in rows:
                raise UserError(f"coco_captions: {str(path)!r} annotations[{i}] refers to image_id {image_id} "
                                "that is not in its 'images' list; the file is inconsistent.")
            image_rows.append(rows[image_id])
        image_table_ids = np.zeros(len(files), dtype=np.int64)
        for image_id, row in rows.items():
            image_table_ids[row] = image_id
        return {"records": Table({"id": np.array(ids, dtype=np.int64), "image_id": np.array(image_ids, dtype=np.int64),
                                  "caption": Strings.build(captions), "image": np.array(image_rows, dtype=np.int32)}),
                "images": Table({"id": image_table_ids, "file_name": Strings.build(files)})}

    def train_texts(self) -> list[str]:
        return self.records("train").column("caption").tolist()

    def text_extras(self) -> dict[str, Any]:
        extras = super().text_extras()
        mask_p = float(self.cfg.get("mask_probability") or 0.0)
        if mask_p > 0:
            spec = (self.cfg.get("processors") or {}).get("text_processor") or {}
            if accepts(PROCESSORS.get(str(spec.get("type"))), "mask_probability"):
                extras["mask_probability"] = mask_p
            else:
                log.warning("coco_captions: mask_probability=%s but text processor %r has no masking; "
                            "training without masked-LM labels", mask_p, spec.get("type"))
        return extras

    def make_dataset(self, split: str, records: Table) -> Dataset:
        spec = self.split_config(split)
        images = self.path(spec.get("images") or ".")
        files, image_rows = self.tables(split)["images"].column("file_name"), records.column("image")
        rows = self.readable_rows(split, records, lambda row: images / files[int(image_rows[row])])
        records = records.take(rows) if rows is not None else records
        ratio = contrastive_ratio(self.cfg, "coco_captions")
        if ratio > 0 and len(np.unique(records.column("image_id"))) < 2:
            raise UserError(f"coco_captions {split}: negatives need captions of at least two images; "
                            "add images or set negative_ratio: 0.")
        masking = float(getattr(self.text_processor, "mask_probability", 0.0) or 0.0) > 0
        mask = masking and (split == "train" or bool(self.cfg.get("mask_eval", False)))
        return COCOMatchingDataset(records, files, images, self.text_processor, self.image_processor,
                                   self.features_processor, self.policy, ratio, int(self.cfg.get("seed", 0)),
                                   _SPLIT_SALT.get(split, 3), mask=mask)

    def model_info(self) -> dict[str, int]:
        return {"vocab_size": int(self.text_processor.vocab_size), "num_labels": 2, **self.features_info()}

    def collate(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        """With ``contrastive: true``, ``targets`` is each item's row in its batch: the column of its own
        image among a two-tower model's [texts x images] scores (what recall@k reads)."""
        batch = super().collate(items)
        if self.cfg.get("contrastive"):
            batch["targets"] = torch.arange(len(items))
        return batch

    def predictions(self, data: dict[str, Any], scores: Any) -> list[dict[str, Any]]:
        """``[{"id", "match_proba"}]``: the probability that the pair matches."""
        ids = data.get("id", [])
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return [{"id": i, "match_proba": p} for i, p in zip(ids, positive_proba(scores).tolist())]


def contrastive_ratio(cfg: Any, name: str) -> float:
    """``negative_ratio``, checked: in [0, 1], and 0 when ``contrastive`` (every caption its own image's)."""
    ratio = float(cfg.get("negative_ratio", 0.5))
    if not 0.0 <= ratio <= 1.0:
        raise UserError(f"{name}: negative_ratio={ratio} must be in [0, 1].")
    if cfg.get("contrastive") and ratio > 0:
        raise UserError(f"{name}: contrastive: true pairs every image with its own caption, but negative_ratio="
                        f"{ratio}; set dataset_config.{name}.negative_ratio: 0.")
    return ratio


def positive_proba(scores: Any) -> torch.Tensor:
    """P(class 1) from ``[N, 2]`` logits (softmax) or one logit per sample (sigmoid)."""
    scores = torch.as_tensor(scores).float()
    if scores.dim() == 2 and scores.size(1) == 2:
        return scores.softmax(-1)[:, 1]
    return scores.reshape(-1).sigmoid()
