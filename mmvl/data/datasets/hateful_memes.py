"""Hateful Memes (Kiela et al. 2020): is this meme (image + overlaid text) hateful?

Each split is a JSONL file of ``{"id", "img": "img/01235.png", "label", "text"}``
(the official ``train.jsonl``, ``dev_seen.jsonl``, ``test_seen.jsonl``; test
lines have no ``label`` and then items have no ``targets``). Image paths are
relative to ``images`` under ``<env.data_dir>/<data_folder>``. Predictions are
written as the challenge's CSV: ``id, proba, label``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from mmvl.data.datasets._common import FileDatasetBuilder, ImageLoading, load_jsonl, require_fields
from mmvl.data.datasets.coco_captions import positive_proba
from mmvl.data.processors import image as _image  # noqa: F401  (registers torchvision_transforms)
from mmvl.data.processors import text as _text  # noqa: F401  (registers bert_tokenizer)
from mmvl.data.processors import vocab as _vocab  # noqa: F401  (registers vocab)
from mmvl.errors import UserError
from mmvl.registry import register_dataset


class HatefulMemesDataset(ImageLoading, Dataset):
    """Items: ``id``, text tokens, ``image`` or features, and ``targets`` (0/1) when labelled."""

    dataset = "hateful_memes"

    def __init__(self, records: list[dict[str, Any]], images: Path, text_processor: Any, image_processor: Any,
                 features_processor: Any, policy: str):
        self.records, self.images = records, images
        self.text_processor, self.image_processor = text_processor, image_processor
        self.features_processor, self.policy = features_processor, policy

    def image_path(self, record: dict[str, Any]) -> Path:
        return self.images / record["img"]

    def make_item(self, index: int) -> dict[str, Any] | None:
        record = self.records[index]
        visual = self.visual_inputs(record)
        if visual is None:
            return None
        item: dict[str, Any] = {"id": record["id"]}
        item.update(self.text_processor(record["text"]))
        item.update(visual)
        if "label" in record:
            item["targets"] = record["label"]
        return item


@register_dataset("hateful_memes")
class HatefulMemesBuilder(FileDatasetBuilder):
    """Binary meme classification; ``prediction_format`` csv with ``id, proba, label`` rows."""

    name = "hateful_memes"
    config_path = "datasets/hateful_memes.yaml"
    prediction_format = "csv"

    def load_records(self, split: str) -> list[dict[str, Any]]:
        path = self.split_file(split, "annotations", "the split's .jsonl file")
        records, labelled = [], None
        for line in load_jsonl(path, self.name, "annotation file"):
            where = f"line {line['_line']}"
            require_fields(line, ("id", "img", "text"), path, self.name, where)
            has_label = line.get("label") is not None
            if labelled is None:
                labelled = has_label
            elif has_label != labelled:
                raise UserError(f"hateful_memes: {str(path)!r} {where} {'has' if has_label else 'lacks'} a label "
                                "unlike the lines before it; a split is either labelled or not.")
            record = {"id": _id(line["id"]), "img": str(line["img"]), "text": str(line["text"])}
            if has_label:
                if line["label"] not in (0, 1) or isinstance(line["label"], bool):
                    raise UserError(f"hateful_memes: {str(path)!r} {where} has label {line['label']!r}; "
                                    "labels are 0 (not hateful) or 1 (hateful).")
                record["label"] = int(line["label"])
            records.append(record)
        return records

    def train_texts(self) -> list[str]:
        return [r["text"] for r in self.records("train")]

    def make_dataset(self, split: str, records: list[dict[str, Any]]) -> Dataset:
        images = self.path(self.cfg.get("images") or ".")
        records = self.keep_readable(split, records, lambda r: images / r["img"])
        return HatefulMemesDataset(records, images, self.text_processor, self.image_processor,
                                   self.features_processor, self.policy)

    def model_info(self) -> dict[str, int]:
        return {"vocab_size": int(self.text_processor.vocab_size), "num_labels": 2, **self.features_info()}

    def predictions(self, data: dict[str, Any], scores: Any) -> list[dict[str, Any]]:
        """The challenge's submission rows: ``id``, ``proba`` (hateful) and ``label`` (proba >= 0.5)."""
        ids = data.get("id", [])
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        proba = positive_proba(scores).tolist()
        return [{"id": i, "proba": p, "label": int(p >= 0.5)} for i, p in zip(ids, proba)]


def _id(value: Any) -> Any:
    """Ids stay ints when they are (so they collate to a tensor); others stay strings."""
    return value if isinstance(value, int) and not isinstance(value, bool) else str(value)
