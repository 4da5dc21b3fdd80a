"""VQA v2 (Goyal et al. 2017) from the official question and annotation JSON files.

Per split: ``questions`` (``{"questions": [{"image_id", "question", "question_id"}]}``),
``annotations`` (``{"annotations": [{"question_id", "answers": [{"answer", ...} x 10], ...}]}``;
null for the unlabelled test split) and the COCO ``images`` folder, with file
names from ``image_pattern`` (``COCO_train2014_{image_id:012d}.jpg``). Paths
are relative to ``<env.data_dir>/<data_folder>``. Targets are soft scores over
an answer vocabulary built from the training answers (``vqa_answer``); with a
``features`` processor, region features keyed by the image file's stem (MMF's
keys) replace the pixels.

A parsed split is two tables (see :mod:`mmvl.data.records`): ``records`` with
``question_id``, ``image_id``, ``question`` and ``answers`` (per question, each distinct
normalised answer as a row of ``answers`` with the number of humans who gave it), and
``answers`` (the split's distinct normalised answers). The dataset maps those to the
answer vocabulary once, vectorised; items are made from the arrays alone.
"""
from __future__ import annotations

import array
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from mmvl.config.components import accepts, component_spec
from mmvl.data.datasets._common import FileDatasetBuilder, ImageLoading, int_id, require_fields, stream_json
from mmvl.data.processors import answers as _answers  # noqa: F401  (registers vqa_answer)
from mmvl.data.processors import image as _image  # noqa: F401  (registers torchvision_transforms)
from mmvl.data.processors import text as _text  # noqa: F401  (registers bert_tokenizer)
from mmvl.data.processors import vocab as _vocab  # noqa: F401  (registers vocab)
from mmvl.data.processors.answers import normalize_answer
from mmvl.data.records import Ragged, RaggedBuilder, Strings, Table
from mmvl.errors import UserError
from mmvl.registry import PROCESSORS, register_dataset


class VQA2Dataset(ImageLoading, Dataset):
    """Items: ``id`` (question id), ``image_id``, text tokens, ``image`` or features, ``targets`` if labelled.

    ``answers`` (labelled splits): per question, answer-vocabulary indices and human counts.
    """

    dataset = "vqa2"

    def __init__(self, records: Table, images: Path, pattern: str, text_processor: Any, answer_processor: Any,
                 image_processor: Any, features_processor: Any, policy: str, answers: Ragged | None = None):
        self.records, self.images, self.pattern = records, images, pattern
        self.question_ids, self.image_ids = records.column("question_id"), records.column("image_id")
        self.questions = records.column("question")
        self.text_processor, self.answer_processor, self.answers = text_processor, answer_processor, answers
        self.image_processor, self.features_processor, self.policy = image_processor, features_processor, policy

    def image_path(self, row: int) -> Path:
        return self.images / image_name(self.pattern, self.image_ids[row])

    def make_item(self, row: int) -> dict[str, Any] | None:
        visual = self.visual_inputs(row)
        if visual is None:
            return None
        item: dict[str, Any] = {"id": int(self.question_ids[row]), "image_id": int(self.image_ids[row])}
        item.update(self.text_processor(self.questions[row]))
        item.update(visual)
        if self.answers is not None and self.answer_processor is not None:
            start, end = self.answers.offsets[row], self.answers.offsets[row + 1]
            item["targets"] = self.answer_processor.targets(self.answers.values["index"][start:end],
                                                            self.answers.values["count"][start:end])["targets"]
        return item


def image_name(pattern: str, image_id: Any) -> str:
    try:
        return pattern.format(image_id=int(image_id))
    except (KeyError, IndexError, ValueError) as e:
        raise UserError(f"vqa2: image_pattern {pattern!r} cannot be filled with image_id={image_id!r} ({e}); "
                        "write it like COCO_train2014_{image_id:012d}.jpg.") from None


def vocabulary_answers(records: Table, table: Table, index: dict[str, int]) -> Ragged:
    """The ``answers`` column mapped to vocabulary indices; answers outside the vocabulary dropped."""
    remap = np.array([index.get(a, -1) for a in table.column("answer")], dtype=np.int64)
    answers = records.column("answers")
    vocab = remap[answers.values["answer"]] if len(remap) else np.zeros(0, dtype=np.int64)
    keep = vocab >= 0
    kept_before = np.concatenate([[0], np.cumsum(keep)])
    return Ragged(kept_before[answers.offsets], index=vocab[keep].astype(np.int32),
                  count=answers.values["count"][keep].astype(np.int32))


@register_dataset("vqa2")
class VQA2Builder(FileDatasetBuilder):
    """VQA v2 with soft-score targets; ``predictions`` gives ``[{"question_id", "answer"}]``."""

    name = "vqa2"
    config_path = "datasets/vqa2.yaml"

    def __init__(self, config: Any, data_dir: str):
        super().__init__(config, data_dir)
        self._oracle: dict[str, dict[str, float]] = {}
        self._answers: dict[str, Ragged] = {}

    def source_files(self, split: str) -> list[Path]:
        files = [self.split_file(split, "questions", "the questions JSON file")]
        labelled = self.split_config(split).get("annotations")
        return files + [self.split_file(split, "annotations", "the annotations JSON file")] if labelled else files

    def load_records(self, split: str) -> dict[str, Table]:
        files = self.source_files(split)
        qpath = files[0]
        qids, image_ids, offsets = array.array("q"), array.array("q"), array.array("q", [0])
        text = bytearray()
        for _, i, q in stream_json(qpath, ("questions",), self.name, "questions file"):
            where = f"questions[{i}]"
            require_fields(q, ("image_id", "question", "question_id"), qpath, self.name, where)
            qids.append(int_id(q["question_id"], qpath, self.name, f"{where}.question_id"))
            image_ids.append(int_id(q["image_id"], qpath, self.name, f"{where}.image_id"))
            text += str(q["question"]).encode("utf-8")
            offsets.append(len(text))
        columns: dict[str, Any] = {"question_id": np.array(qids, dtype=np.int64),
                                   "image_id": np.array(image_ids, dtype=np.int64),
                                   "question": Strings.from_buffer(text, offsets)}
        tables = {"records": columns}
        if len(files) > 1:
            columns["answers"], tables["answers"] = self._parse_answers(columns["question_id"], files[1])
        return {name: Table(cols) if isinstance(cols, dict) else cols for name, cols in tables.items()}

    def _parse_answers(self, qids: np.ndarray, apath: Path) -> tuple[Ragged, Table]:
        """Per question (in ``qids`` order): its distinct normalised answers and their counts."""
        normalised: dict[str, int] = {}  # raw answer -> id of its normalised form (-1: empty)
        distinct: dict[str, int] = {}
        ann_qids = array.array("q")
        grouped = RaggedBuilder("answer", "count")
        for _, i, a in stream_json(apath, ("annotations",), self.name, "annotations file"):
            require_fields(a, ("question_id", "answers"), apath, self.name, f"annotations[{i}]")
            if not isinstance(a["answers"], list):
                raise UserError(f"vqa2: {str(apath)!r} annotations[{i}].answers must be a list of objects.")
            counts: dict[int, int] = {}
            for j, ans in enumerate(a["answers"]):
                require_fields(ans, ("answer",), apath, self.name, f"annotations[{i}].answers[{j}]")
                raw = str(ans["answer"])
                k = normalised.get(raw)
                if k is None:
                    norm = normalize_answer(raw)
                    k = distinct.setdefault(norm, len(distinct)) if norm else -1
                    normalised[raw] = k
                if k >= 0:
                    counts[k] = counts.get(k, 0) + 1
            ann_qids.append(int_id(a["question_id"], apath, self.name, f"annotations[{i}].question_id"))
            grouped.add(answer=list(counts), count=list(counts.values()))
        per_annotation = grouped.build({"answer": np.int32, "count": np.int32})
        found = np.array(ann_qids, dtype=np.int64)
        order = np.argsort(found, kind="stable")
        pos = np.searchsorted(found[order], qids)
        pos = np.minimum(pos, max(len(found) - 1, 0))
        matched = order[pos] if len(found) else np.zeros(len(qids), dtype=np.int64)
        missing = np.flatnonzero(found[matched] != qids) if len(found) else np.arange(len(qids))
        if len(missing):
            raise UserError(f"vqa2: {str(apath)!r} has no annotation for question_id {int(qids[missing[0]])}; "
                            "are the questions and annotations files of the same split?")
        return per_annotation.take(matched), Table({"answer": Strings.build(distinct)})

    def train_texts(self) -> list[str]:
        return self.records("train").column("question").tolist()

    @property
    def answer_processor(self) -> Any:
        def counts() -> dict[str, int]:
            records, table = self._labelled("train")
            answers = records.column("answers")
            totals = np.bincount(answers.values["answer"], weights=answers.values["count"], minlength=len(table))
            return dict(zip(table.column("answer"), totals.astype(np.int64).tolist()))

        def lists() -> list[list[str]]:
            records, table = self._labelled("train")
            names = table.column("answer").tolist()
            return [[names[a] for a, c in zip(row["answer"], row["count"]) for _ in range(c)]
                    for row in (records.column("answers")[i] for i in range(len(records)))]

        extra: dict[str, Any] = {}
        if not self.has_vocab_file("answer_processor"):
            spec = (self.cfg.get("processors") or {}).get("answer_processor")
            cls = PROCESSORS.get(component_spec(spec, "answer_processor")[0]) if spec else None
            counted = cls is not None and accepts(cls, "answer_counts")
            extra = {"answer_counts": counts} if counted else {"answers": lists}
        proc = self.processor("answer_processor", **extra)
        if proc is None:
            raise UserError("vqa2: processors.answer_processor is not set; use {type: vqa_answer}.")
        return proc

    def _labelled(self, split: str) -> tuple[Table, Table]:
        records = self.records(split)
        if "answers" not in records:
            raise UserError("vqa2: the train split has no annotations to build the answer vocabulary from; "
                            "set splits.train.annotations or processors.answer_processor.params.vocab_file.")
        return records, self.tables(split)["answers"]

    def prepare_split(self, split: str) -> None:
        super().prepare_split(split)
        self.answer_processor  # noqa: B018  (fits and caches the answer vocabulary; model_info needs it)

    def vocabulary_answers(self, split: str) -> Ragged | None:
        """The split's answers as (answer-vocabulary index, human count) rows; None when unlabelled."""
        if split not in self._answers:
            records = self.records(split)
            if "answers" not in records:
                return None
            self._answers[split] = vocabulary_answers(records, self.tables(split)["answers"],
                                                      self.answer_processor.index)
        return self._answers[split]

    def make_dataset(self, split: str, records: Table) -> Dataset:
        spec = self.split_config(split)
        images = self.path(spec.get("images") or ".")
        pattern = str(spec.get("image_pattern") or "{image_id}.jpg")
        answers = self.vocabulary_answers(split)
        image_ids = records.column("image_id")
        rows = self.readable_rows(split, records, lambda row: images / image_name(pattern, image_ids[row]))
        if rows is not None:  # some images cannot be read: drop their questions
            records, answers = records.take(rows), answers.take(rows) if answers is not None else None
        return VQA2Dataset(records, images, pattern, self.text_processor,
                           self.answer_processor if answers is not None else None, self.image_processor,
                           self.features_processor, self.policy, answers)

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
            self._oracle[split] = {}
            dataset = self.build(split)
            answers = getattr(dataset, "answers", None)
            if answers is not None and len(answers):
                scores = np.minimum(answers.values["count"] / 3.0, 1.0)
                best = np.zeros(len(answers))
                lengths = np.diff(answers.offsets)
                rows = np.repeat(np.arange(len(answers)), lengths)
                np.maximum.at(best, rows, scores)
                self._oracle[split] = {"vqa_accuracy/oracle": sum(best.tolist()) / len(best)}
        return dict(self._oracle[split])
