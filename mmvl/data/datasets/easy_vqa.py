"""easy-VQA (the ``easy-vqa`` package on PyPI, MIT): 64x64 images of one coloured shape, and questions about it.

The package installs its data beside its code: ``data/{train,test}/questions.json`` (a list of
``[question, answer, image_id]``), ``data/{train,test}/images/<image_id>.png`` (4,000 training and
1,000 test images; 38,575 and 9,673 questions) and ``data/answers.txt`` (13 answers). mmvl reads
those files itself (JSON and PNG through PIL; nothing is unpickled or imported from the package),
so ``data_root`` can also name a folder of the same layout.

Splits: ``test`` is the package's test set; ``val`` is the questions of the ``val_images`` training
images with the highest ids, held out of ``train``, so that choosing a checkpoint never looks at
``test``. Every question has one answer: the target is its index in the answer vocabulary
(``vqa_answer``, built from the training answers), for the models' ``cross_entropy``. The question
type comes from the question's form (``is ...?``/``does ...?`` yes/no, ``... color ...`` colour, else
shape) and feeds ``accuracy/<type>`` and the per-type answer prior (``accuracy/prior/<type>``).
"""
from __future__ import annotations

import importlib.util
import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from mmvl.data.datasets._common import FileDatasetBuilder
from mmvl.data.datasets.image_files import decode_image
from mmvl.data.processors import answers as _answers  # noqa: F401  (registers vqa_answer)
from mmvl.data.processors import image as _image  # noqa: F401  (registers torchvision_transforms)
from mmvl.data.processors import vocab as _vocab  # noqa: F401  (registers vocab)
from mmvl.data.processors.answers import normalize_answer
from mmvl.data.records import Strings, Table
from mmvl.errors import UserError
from mmvl.labels import IGNORE_INDEX
from mmvl.registry import register_dataset

log = logging.getLogger("mmvl")

#: metric names of the question types (``accuracy/<name>``), in type-index order
TYPE_NAMES = ["yes_no", "shape", "color"]
SPLITS = ("train", "val", "test")
INSTALL_HINT = "pip install mmvl[easy_vqa] (or pip install easy-vqa)"


def question_words(question: str) -> list[str]:
    """A question's lower-case words, its ``?`` dropped: the one word split the type and content readers share."""
    return question.lower().replace("?", " ").split()


def question_type(question: str) -> int:
    """0 yes/no (``is``/``does`` questions), 2 colour (the question names colour), 1 shape (the other ``what`` ones)."""
    words = question_words(question)
    if words and words[0] in ("is", "does", "are", "do"):
        return 0
    if "color" in words or "colour" in words:
        return 2
    if words and words[0] == "what":
        return 1
    raise UserError(f"easy_vqa: question {question!r} is neither a yes/no, a colour nor a shape question; "
                    "easy-VQA's files ask only those (is the data folder another dataset's?).")


def package_root() -> Path:
    """The installed ``easy_vqa`` package's data folder (found, not imported)."""
    spec = importlib.util.find_spec("easy_vqa")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"easy_vqa: the easy-vqa package is not installed; {INSTALL_HINT}, or set "
                        "dataset_config.easy_vqa.data_root to a folder with its train/ and test/ files.")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


class EasyVQADataset(Dataset):
    """Items: ``id`` (question index in its file), ``image_id``, text tokens, ``image``, ``targets``, ``question_type``."""

    def __init__(self, records: Table, pixels: torch.Tensor, image_rows: np.ndarray, targets: np.ndarray,
                 text_processor: Any, image_processor: Any):
        self.records = records
        self.ids, self.image_ids = records.column("question_id"), records.column("image_id")
        self.types, self.questions = records.column("type"), records.column("question")
        self.pixels, self.image_rows, self.targets = pixels, image_rows, targets  # pixels: uint8 N x 3 x H x W
        self.text_processor, self.image_processor = text_processor, image_processor

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        item: dict[str, Any] = {"id": int(self.ids[index]), "image_id": int(self.image_ids[index])}
        item.update(self.text_processor(self.questions[index]))
        image = self.pixels[int(self.image_rows[index])]
        item["image"] = self.image_processor(image) if self.image_processor is not None else image.float() / 255.0
        item.update(targets=int(self.targets[index]), question_type=int(self.types[index]))
        return item


@register_dataset("easy_vqa")
class EasyVQABuilder(FileDatasetBuilder):
    """easy-VQA from the installed package's files; ``predictions`` gives ``[{"question_id", "answer"}]``."""

    name = "easy_vqa"
    config_path = "datasets/easy_vqa.yaml"

    def __init__(self, config: Any, data_dir: str):
        super().__init__(config, data_dir)
        root = self.cfg.get("data_root")
        self.root = Path(str(root)).expanduser() if root else None
        self.val_images = int(self.cfg.get("val_images") or 0)
        if self.val_images < 0:
            raise UserError(f"{self.name}: val_images={self.val_images} must be 0 or more (training images held out "
                            "as the val split).")
        self._priors: dict[int, str] | None = None

    def data_root(self) -> Path:
        root = self.root if self.root is not None else package_root()
        if not (root / "train" / "questions.json").is_file():
            raise UserError(f"{self.name}: {str(root)!r} has no train/questions.json; set data_root to easy-VQA's data "
                            f"folder (train/, test/ with images/ and questions.json), or null for the package's "
                            f"({INSTALL_HINT}).")
        return root

    def _file_split(self, split: str) -> str:
        if split not in SPLITS:
            raise UserError(f"{self.name}: unknown split {split!r}; use one of {', '.join(SPLITS)}.")
        return "test" if split == "test" else "train"

    def source_files(self, split: str) -> list[Path]:
        return [self.data_root() / self._file_split(split) / "questions.json"]

    def images_folder(self, split: str) -> Path:
        return self.data_root() / self._file_split(split) / "images"

    def load_records(self, split: str) -> dict[str, Table]:
        path = self.source_files(split)[0]
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, OSError) as e:
            raise UserError(f"{self.name}: {str(path)!r} does not read as JSON ({type(e).__name__}: {str(e)[:80]}); "
                            f"reinstall the package ({INSTALL_HINT}).") from None
        questions, answers, image_ids, types = [], [], [], []
        for i, row in enumerate(rows if isinstance(rows, list) else [None]):
            if not (isinstance(row, list) and len(row) == 3 and isinstance(row[2], int)):
                raise UserError(f"{self.name}: {str(path)!r} entry {i} is {row!r}; each entry must be "
                                "[question, answer, image_id].")
            questions.append(str(row[0]))
            answers.append(normalize_answer(str(row[1])))
            image_ids.append(row[2])
            types.append(question_type(str(row[0])))
        return {"records": Table({"question_id": np.arange(len(rows), dtype=np.int64),
                                  "image_id": np.asarray(image_ids, dtype=np.int64),
                                  "type": np.asarray(types, dtype=np.int64),
                                  "question": Strings.build(questions), "answer": Strings.build(answers)})}

    def check_split(self, split: str) -> None:
        if split == "val" and self.val_images == 0:
            raise UserError(f"{self.name}: val_images is 0, so there is no val split; set val_images "
                            "(e.g. 500) or use run_type train_test.")

    def split_questions(self, split: str) -> Table:
        """All of ``split``'s questions, uncapped (``train`` and ``val`` share the training file, split by image)."""
        table = self.tables(self._file_split(split))["records"]
        if split != "test":
            ids = np.unique(table.column("image_id"))
            self.check_split(split)
            if self.val_images >= len(ids):
                raise UserError(f"{self.name}: val_images={self.val_images} leaves no training images (the "
                                f"training file has {len(ids)}); use fewer.")
            held = ids[len(ids) - self.val_images:] if self.val_images else ids[:0]
            is_val = np.isin(table.column("image_id"), held)
            table = table.take(np.flatnonzero(is_val if split == "val" else ~is_val))
        return table

    def samples(self, split: str) -> Table:
        """``split``'s samples before ``max_samples``: its questions (a subclass may derive others from them)."""
        return self.split_questions(split)

    def records(self, split: str) -> Table:
        """``split``'s samples, capped at ``max_samples``."""
        if split not in self._records:
            table = self.samples(split)
            cap = self.cfg.get("max_samples")
            self._records[split] = table.head(int(cap)) if cap else table
        return self._records[split]

    def train_texts(self) -> list[str]:
        return self.records("train").column("question").tolist()

    @property
    def answer_processor(self) -> Any:
        extra = {} if self.has_vocab_file("answer_processor") else {
            "answer_counts": lambda: dict(Counter(self.records("train").column("answer").tolist()))}
        proc = self.processor("answer_processor", **extra)
        if proc is None:
            raise UserError("easy_vqa: processors.answer_processor is not set; use {type: vqa_answer}.")
        return proc

    def prepare_split(self, split: str) -> None:
        super().prepare_split(split)
        self.answer_processor  # noqa: B018  (fits and caches the answer vocabulary; model_info needs it)

    def load_images(self, split: str, image_ids: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        """The images ``image_ids`` as uint8 (n x 3 x H x W) and which of them decoded (PIL; all when ``error``)."""
        folder = self.images_folder(split)
        pixels, ok = [], np.ones(len(image_ids), dtype=bool)
        for k, image_id in enumerate(image_ids.tolist()):
            path = folder / f"{image_id}.png"
            try:
                array = np.asarray(decode_image(path), dtype=np.uint8)
            except (OSError, ValueError) as e:
                if self.policy == "error":
                    raise UserError(f"{self.name}: image {str(path)!r} cannot be read ({type(e).__name__}); reinstall "
                                    f"the package ({INSTALL_HINT}) or set on_bad_image: skip.") from None
                ok[k] = False
                continue
            if pixels and array.shape != pixels[0].shape:
                raise UserError(f"{self.name}: image {str(path)!r} is {array.shape[1]}x{array.shape[0]}, the others "
                                f"{pixels[0].shape[1]}x{pixels[0].shape[0]}; every image must have one size.")
            pixels.append(array)
        if not pixels:
            raise UserError(f"{self.name} {split}: none of the {len(image_ids)} images in {str(folder)!r} can be read.")
        return torch.from_numpy(np.stack(pixels)).permute(0, 3, 1, 2).contiguous(), ok

    def readable_images(self, split: str, records: Table) -> tuple[Table, torch.Tensor, np.ndarray]:
        """``records`` less those whose image cannot be read (``on_bad_image: skip``), their images (uint8
        n x 3 x H x W) and each record's row in them; shared with ``easy_vqa_generative``."""
        image_ids = np.unique(records.column("image_id"))
        pixels, ok = self.load_images(split, image_ids)
        if not ok.all():
            keep = np.flatnonzero(np.isin(records.column("image_id"), image_ids[ok]))
            log.warning("%s %s: skipped %d of %d samples whose image cannot be read", self.name, split,
                        len(records) - len(keep), len(records))
            records, image_ids = records.take(keep), image_ids[ok]
        return records, pixels, np.searchsorted(image_ids, records.column("image_id"))

    def make_dataset(self, split: str, records: Table) -> Dataset:
        records, pixels, rows = self.readable_images(split, records)
        index = self.answer_processor.index
        targets = np.array([index.get(a, IGNORE_INDEX) for a in records.column("answer").tolist()], dtype=np.int64)
        return EasyVQADataset(records, pixels, rows, targets, self.text_processor, self.image_processor)

    def model_info(self) -> dict[str, int]:
        return {"vocab_size": int(self.text_processor.vocab_size), "num_labels": self.answer_processor.num_answers}

    def predictions(self, data: dict[str, Any], scores: Any) -> list[dict[str, Any]]:
        ids = data.get("id", [])
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        best = torch.as_tensor(scores).argmax(-1).tolist()
        return [{"question_id": int(q), "answer": self.answer_processor.answer(a)} for q, a in zip(ids, best)]

    def prior_answers(self) -> dict[int, str]:
        """The most frequent training answer per question type (ties: the alphabetically first)."""
        if self._priors is None:
            counts: dict[int, Counter] = {t: Counter() for t in range(len(TYPE_NAMES))}
            train = self.records("train")
            for t, a in zip(train.column("type").tolist(), train.column("answer").tolist()):
                counts[t][a] += 1
            self._priors = {t: min(c, key=lambda a: (-c[a], a)) for t, c in counts.items() if c}
        return self._priors

    def extra_metrics(self, split: str) -> dict[str, float]:
        """``accuracy/prior`` and ``accuracy/prior/<type>``: answering each type with its most frequent training
        answer, the reference each ``accuracy/...`` must beat to show the model read the image."""
        records, prior = self.records(split), self.prior_answers()
        types = records.column("type")
        hits = np.array([prior.get(t) == a for t, a in zip(types.tolist(), records.column("answer").tolist())])
        out = {"accuracy/prior": float(hits.mean()) if len(hits) else 0.0}
        for t, name in enumerate(TYPE_NAMES):
            if (types == t).any():
                out[f"accuracy/prior/{name}"] = float(hits[types == t].mean())
        return out
