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
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from mmvl.data.datasets._common import (FileDatasetBuilder, ImageLoading, field_list, load_json,
                                        require_fields)
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

    def __init__(self, records: list[dict[str, Any]], images: Path, text_processor: Any, image_processor: Any,
                 features_processor: Any, policy: str, negative_ratio: float, seed: int, salt: int,
                 mask: bool = False):
        self.records, self.images = records, images
        self.text_processor, self.image_processor = text_processor, image_processor
        self.features_processor, self.policy = features_processor, policy
        self.negative_ratio, self.seed, self.salt = float(negative_ratio), int(seed), int(salt)
        self.mask, self.epoch = bool(mask), 0

    def set_epoch(self, epoch: int) -> None:
        """Called by the train loader before each epoch: masking differs between epochs."""
        self.epoch = int(epoch)

    def image_path(self, record: dict[str, Any]) -> Path:
        return self.images / record["file_name"]

    def partner(self, index: int) -> int:
        """``index`` itself (a match) or a deterministic caption of another image (a mismatch)."""
        if self.negative_ratio <= 0:
            return index
        rng = np.random.default_rng([self.seed, self.salt, index])
        if rng.random() >= self.negative_ratio:
            return index
        image_id, n = self.records[index]["image_id"], len(self.records)
        j = int(rng.integers(n))
        for step in range(n):  # the first caption of another image at or after j
            k = (j + step) % n
            if self.records[k]["image_id"] != image_id:
                return k
        return index  # a single image: no negative exists (the builder refuses this case)

    def make_item(self, index: int) -> dict[str, Any] | None:
        record = self.records[index]
        visual = self.visual_inputs(record)
        if visual is None:
            return None
        other = self.records[self.partner(index)]
        item: dict[str, Any] = {"id": record["id"], "image_id": record["image_id"], "caption_id": other["id"]}
        if self.mask:  # the stream id 1 keeps masking draws apart from partner()'s
            item.update(self.text_processor(other["caption"], rng=[self.seed, self.salt, index, self.epoch, 1]))
        else:
            item.update(self.text_processor(other["caption"]))
        item.update(visual)
        item["targets"] = int(other["image_id"] == record["image_id"])
        return item


@register_dataset("coco_captions")
class COCOCaptionsBuilder(FileDatasetBuilder):
    """COCO captions turned into a binary matching task (``num_labels`` 2)."""

    name = "coco_captions"
    config_path = "datasets/coco_captions.yaml"

    def load_records(self, split: str) -> list[dict[str, Any]]:
        path = self.split_file(split, "annotations", "the captions JSON file")
        doc = load_json(path, self.name, "captions file")
        files: dict[Any, str] = {}
        for i, image in enumerate(field_list(doc, "images", path, self.name)):
            require_fields(image, ("id", "file_name"), path, self.name, f"images[{i}]")
            files[image["id"]] = str(image["file_name"])
        records = []
        for i, ann in enumerate(field_list(doc, "annotations", path, self.name)):
            require_fields(ann, ("id", "image_id", "caption"), path, self.name, f"annotations[{i}]")
            if ann["image_id"] not in files:
                raise UserError(f"coco_captions: {str(path)!r} annotations[{i}] refers to image_id {ann['image_id']} "
                                "that is not in its 'images' list; the file is inconsistent.")
            records.append({"id": ann["id"], "image_id": ann["image_id"], "caption": str(ann["caption"]),
                            "file_name": files[ann["image_id"]]})
        return records

    def train_texts(self) -> list[str]:
        return [r["caption"] for r in self.records("train")]

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

    def make_dataset(self, split: str, records: list[dict[str, Any]]) -> Dataset:
        spec = self.split_config(split)
        images = self.path(spec.get("images") or ".")
        records = self.keep_readable(split, records, lambda r: images / r["file_name"])
        ratio = float(self.cfg.get("negative_ratio", 0.5))
        if not 0.0 <= ratio <= 1.0:
            raise UserError(f"coco_captions: negative_ratio={ratio} must be in [0, 1].")
        if ratio > 0 and len({r["image_id"] for r in records}) < 2:
            raise UserError(f"coco_captions {split}: negatives need captions of at least two images; "
                            "add images or set negative_ratio: 0.")
        masking = float(getattr(self.text_processor, "mask_probability", 0.0) or 0.0) > 0
        mask = masking and (split == "train" or bool(self.cfg.get("mask_eval", False)))
        return COCOMatchingDataset(records, images, self.text_processor, self.image_processor,
                                   self.features_processor, self.policy, ratio, int(self.cfg.get("seed", 0)),
                                   _SPLIT_SALT.get(split, 3), mask=mask)

    def model_info(self) -> dict[str, int]:
        return {"vocab_size": int(self.text_processor.vocab_size), "num_labels": 2, **self.features_info()}

    def predictions(self, data: dict[str, Any], scores: Any) -> list[dict[str, Any]]:
        """``[{"id", "match_proba"}]``: the probability that the pair matches."""
        ids = data.get("id", [])
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return [{"id": i, "match_proba": p} for i, p in zip(ids, positive_proba(scores).tolist())]


def positive_proba(scores: Any) -> torch.Tensor:
    """P(class 1) from ``[N, 2]`` logits (softmax) or one logit per sample (sigmoid)."""
    scores = torch.as_tensor(scores).float()
    if scores.dim() == 2 and scores.size(1) == 2:
        return scores.softmax(-1)[:, 1]
    return scores.reshape(-1).sigmoid()
