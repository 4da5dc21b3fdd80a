"""VQA v2 (Goyal et al. 2017) from the official question and annotation JSON files.

Per split: ``questions`` (``{"questions": [{"image_id", "question", "question_id"}]}``),
``annotations`` (``{"annotations": [{"question_id", "answers": [{"answer", ...} x 10], ...}]}``;
null for the unlabelled test split) and the COCO ``images`` folder, with file
names from ``image_pattern`` (``COCO_train2014_{image_id:012d}.jpg``). Paths
are relative to ``<env.data_dir>/<data_folder>``. Targets are soft scores over
an answer vocabulary built from the training answers (``vqa_answer``); with a
``features`` processor, region features keyed by the image file's stem (MMF's
keys) replace the pixels.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from mmvl.data.datasets._common import (FileDatasetBuilder, ImageLoading, field_list, load_json,
                                        require_fields)
from mmvl.data.processors import answers as _answers  # noqa: F401  (registers vqa_answer)
from mmvl.data.processors import image as _image  # noqa: F401  (registers torchvision_transforms)
from mmvl.data.processors import text as _text  # noqa: F401  (registers bert_tokenizer)
from mmvl.data.processors import vocab as _vocab  # noqa: F401  (registers vocab)
from mmvl.data.processors.answers import soft_scores
from mmvl.errors import UserError
from mmvl.registry import register_dataset


class VQA2Dataset(ImageLoading, Dataset):
    """Items: ``id`` (question id), ``image_id``, text tokens, ``image`` or features, ``targets`` if labelled."""

    dataset = "vqa2"

    def __init__(self, records: list[dict[str, Any]], images: Path, pattern: str, text_processor: Any,
                 answer_processor: Any, image_processor: Any, features_processor: Any, policy: str):
        self.records, self.images, self.pattern = records, images, pattern
        self.text_processor, self.answer_processor = text_processor, answer_processor
        self.image_processor, self.features_processor, self.policy = image_processor, features_processor, policy

    def image_path(self, record: dict[str, Any]) -> Path:
        return self.images / image_name(self.pattern, record["image_id"])

    def make_item(self, index: int) -> dict[str, Any] | None:
        record = self.records[index]
        visual = self.visual_inputs(record)
        if visual is None:
            return None
        item: dict[str, Any] = {"id": record["question_id"], "image_id": record["image_id"]}
        item.update(self.text_processor(record["question"]))
        item.update(visual)
        if "answers" in record and self.answer_processor is not None:
            item["targets"] = self.answer_processor(record["answers"])["targets"]
        return item


def image_name(pattern: str, image_id: Any) -> str:
    try:
        return pattern.format(image_id=int(image_id))
    except (KeyError, IndexError, ValueError) as e:
        raise UserError(f"vqa2: image_pattern {pattern!r} cannot be filled with image_id={image_id!r} ({e}); "
                        "write it like COCO_train2014_{image_id:012d}.jpg.") from None


@register_dataset("vqa2")
class VQA2Builder(FileDatasetBuilder):
    """VQA v2 with soft-score targets; ``predictions`` gives ``[{"question_id", "answer"}]``."""

    name = "vqa2"
    config_path = "datasets/vqa2.yaml"

    def __init__(self, config: Any, data_dir: str):
        super().__init__(config, data_dir)
        self._oracle: dict[str, dict[str, float]] = {}

    def load_records(self, split: str) -> list[dict[str, Any]]:
        spec = self.split_config(split)
        qpath = self.split_file(split, "questions", "the questions JSON file")
        questions = field_list(load_json(qpath, self.name, "questions file"), "questions", qpath, self.name)
        records = []
        for i, q in enumerate(questions):
            require_fields(q, ("image_id", "question", "question_id"), qpath, self.name, f"questions[{i}]")
            records.append({"question_id": q["question_id"], "image_id": q["image_id"], "question": q["question"]})
        if spec.get("annotations"):
            self._attach_answers(records, self.path(spec["annotations"]))
        return records

    def _attach_answers(self, records: list[dict[str, Any]], apath: Path) -> None:
        annotations = field_list(load_json(apath, self.name, "annotations file"), "annotations", apath, self.name)
        by_question: dict[Any, list[str]] = {}
        for i, a in enumerate(annotations):
            require_fields(a, ("question_id", "answers"), apath, self.name, f"annotations[{i}]")
            if not isinstance(a["answers"], list):
                raise UserError(f"vqa2: {str(apath)!r} annotations[{i}].answers must be a list of objects.")
            for j, ans in enumerate(a["answers"]):
                require_fields(ans, ("answer",), apath, self.name, f"annotations[{i}].answers[{j}]")
            by_question[a["question_id"]] = [str(ans["answer"]) for ans in a["answers"]]
        for r in records:
            if r["question_id"] not in by_question:
                raise UserError(f"vqa2: {str(apath)!r} has no annotation for question_id {r['question_id']}; "
                                "are the questions and annotations files of the same split?")
            r["answers"] = by_question[r["question_id"]]

    def train_texts(self) -> list[str]:
        return [r["question"] for r in self.records("train")]

    @property
    def answer_processor(self) -> Any:
        def train_answers() -> list[list[str]]:
            records = self.records("train")
            if not records or "answers" not in records[0]:
                raise UserError("vqa2: the train split has no annotations to build the answer vocabulary from; "
                                "set splits.train.annotations or processors.answer_processor.params.vocab_file.")
            return [r["answers"] for r in records]

        extra = {} if self.has_vocab_file("answer_processor") else {"answers": train_answers}
        proc = self.processor("answer_processor", **extra)
        if proc is None:
            raise UserError("vqa2: processors.answer_processor is not set; use {type: vqa_answer}.")
        return proc

    def make_dataset(self, split: str, records: list[dict[str, Any]]) -> Dataset:
        spec = self.split_config(split)
        images = self.path(spec.get("images") or ".")
        pattern = str(spec.get("image_pattern") or "{image_id}.jpg")
        records = self.keep_readable(split, records, lambda r: images / image_name(pattern, r["image_id"]))
        labelled = bool(records) and "answers" in records[0]
        return VQA2Dataset(records, images, pattern, self.text_processor,
                           self.answer_processor if labelled else None, self.image_processor,
                           self.features_processor, self.policy)

    def model_info(self) -> dict[str, int]:
        return {"vocab_size": int(self.text_processor.vocab_size), "num_labels": self.answer_processor.num_answers,
                **self.features_info()}

    def predictions(self, data: dict[str, Any], scores: Any) -> list[dict[str, Any]]:
        ids = data.get("id", [])
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        best = torch.as_tensor(scores).argmax(-1).tolist()
        return [{"question_id": int(q), "answer": self.answer_processor.answer(a)} for q, a in zip(ids, best)]

    def extra_metrics(self, split: str) -> dict[str, float]:
        """``vqa_accuracy/oracle``: the best VQA accuracy reachable with this answer vocabulary."""
        if split not in self._oracle:
            records = self.build(split).records  # type: ignore[attr-defined]
            self._oracle[split] = {}
            if records and "answers" in records[0]:
                index = self.answer_processor.index
                best = [max([s for a, s in soft_scores(r["answers"]).items() if a in index], default=0.0)
                        for r in records]
                self._oracle[split] = {"vqa_accuracy/oracle": sum(best) / len(best)}
        return dict(self._oracle[split])
