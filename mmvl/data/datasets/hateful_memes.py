"""Hateful Memes (Kiela et al. 2020): is this meme (image + overlaid text) hateful?

Each split is a JSONL file of ``{"id", "img": "img/01235.png", "label", "text"}``
(the official ``train.jsonl``, ``dev_seen.jsonl``, ``test_seen.jsonl``; test
lines have no ``label`` and then items have no ``targets``). Image paths are
relative to ``images`` under ``<env.data_dir>/<data_folder>``. Predictions are
written as the challenge's CSV: ``id, proba, label``. A parsed split is a table
(:mod:`mmvl.data.records`) of ``id`` (integers, or strings when any id is not one),
``img``, ``text`` and ``label`` (labelled splits).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from mmvl.data.datasets._common import FileDatasetBuilder, ImageLoading, load_jsonl, require_fields
from mmvl.data.records import Strings, Table
from mmvl.data.datasets.coco_captions import positive_proba
from mmvl.data.processors import image as _image  # noqa: F401  (registers torchvision_transforms)
from mmvl.data.processors import text as _text  # noqa: F401  (registers bert_tokenizer)
from mmvl.data.processors import vocab as _vocab  # noqa: F401  (registers vocab)
from mmvl.errors import UserError
from mmvl.registry import register_dataset


class HatefulMemesDataset(ImageLoading, Dataset):
    """Items: ``id``, text tokens, ``image`` or features, and ``targets`` (0/1) when labelled."""

    dataset = "hateful_memes"

    def __init__(self, records: Table, images: Path, text_processor: Any, image_processor: Any,
                 features_processor: Any, policy: str):
        self.records, self.images = records, images
        self.ids, self.img, self.text = records.column("id"), records.column("img"), records.column("text")
        self.labels = records.column("label") if "label" in records else None
        self.text_processor, self.image_processor = text_processor, image_processor
        self.features_processor, self.policy = features_processor, policy

    def image_path(self, row: int) -> Path:
        return self.images / self.img[row]

    def make_item(self, row: int) -> dict[str, Any] | None:
        visual = self.visual_inputs(row)
        if visual is None:
            return None
        sample_id = self.ids[row]
        item: dict[str, Any] = {"id": sample_id if isinstance(sample_id, str) else int(sample_id)}
        item.update(self.text_processor(self.text[row]))
        item.update(visual)
        if self.labels is not None:
            item["targets"] = int(self.labels[row])
        return item


@register_dataset("hateful_memes")
class HatefulMemesBuilder(FileDatasetBuilder):
    """Binary meme classification; ``prediction_format`` csv with ``id, proba, label`` rows."""

    name = "hateful_memes"
    config_path = "datasets/hateful_memes.yaml"
    prediction_format = "csv"

    def source_files(self, split: str) -> list[Path]:
        return [self.split_file(split, "annotations", "the split's .jsonl file")]

    def load_records(self, split: str) -> Table:
        path = self.source_files(split)[0]
        ids, imgs, texts, labels, labelled = [], [], [], [], None
        for line in load_jsonl(path, self.name, "annotation file"):
            where = f"line {line['_line']}"
            require_fields(line, ("id", "img", "text"), path, self.name, where)
            has_label = line.get("label") is not None
            if labelled is None:
                labelled = has_label
            elif has_label != labelled:
                raise UserError(f"hateful_memes: {str(path)!r} {where} {'has' if has_label else 'lacks'} a label "
                                "unlike the lines before it; a split is either labelled or not.")
            if has_label:
                if line["label"] not in (0, 1) or isinstance(line["label"], bool):
                    raise UserError(f"hateful_memes: {str(path)!r} {where} has label {line['label']!r}; "
                                    "labels are 0 (not hateful) or 1 (hateful).")
                labels.append(int(line["label"]))
            ids.append(line["id"])
            imgs.append(str(line["img"]))
            texts.append(str(line["text"]))
        integer = all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        columns: dict[str, Any] = {"id": np.array(ids, dtype=np.int64) if integer else Strings.build(map(str, ids)),
                                   "img": Strings.build(imgs), "text": Strings.build(texts)}
        if labelled:
            columns["label"] = np.array(labels, dtype=np.int8)
        return Table(columns)

    def train_texts(self) -> list[str]:
        return self.records("train").column("text").tolist()

    def make_dataset(self, split: str, records: Table) -> Dataset:
        images = self.path(self.cfg.get("images") or ".")
        img = records.column("img")
        rows = self.readable_rows(split, records, lambda row: images / img[row])
        return HatefulMemesDataset(records.take(rows) if rows is not None else records, images,
                                   self.text_processor, self.image_processor, self.features_processor, self.policy)

    def model_info(self) -> dict[str, int]:
        return {"vocab_size": int(self.text_processor.vocab_size), "num_labels": 2, **self.features_info()}

    def predictions(self, data: dict[str, Any], scores: Any) -> list[dict[str, Any]]:
        """The challenge's submission rows: ``id``, ``proba`` (hateful) and ``label`` (proba >= 0.5)."""
        ids = data.get("id", [])
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        proba = positive_proba(scores).tolist()
        return [{"id": i, "proba": p, "label": int(p >= 0.5)} for i, p in zip(ids, proba)]

