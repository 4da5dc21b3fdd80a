"""``hf_dataset``: a Hugging Face dataset on disk (a ``save_to_disk`` folder, or parquet files) as an
mmvl dataset; ``datasets`` and ``pyarrow`` are imported only when it is built (``pip install 'mmvl[hf]'``).

A split is Arrow, memory-mapped: rows are read when a DataLoader worker asks for them, never the
whole split into memory. Parquet files are turned into Arrow once, in mmvl's cache folder. Nothing
downloads: a hub name where a folder is expected is refused with the way to download it.

``task`` says what a row is (``columns`` maps each of the task's keys to the dataset's column,
the task's own names by default):

- ``conversation``: the_cauldron's layout, ``images`` (a list of images; none: text-only) and
  ``texts`` (``[{user, assistant}, ...]``); the image goes before the first user message.
  ``train`` labels every assistant turn, ``val``/``test`` the last, their reference;
- ``vqa``: ``image``, ``question``, ``answer`` (a string, or a list of human answers);
- ``caption``: ``image``, ``caption``, the prompt ``caption_prompt``;
- ``classification``: ``image``, ``text``, ``label`` (a class index: ``targets``), for a classifier;
- ``contrastive``: ``image``, ``caption`` (its tokens), for a two-tower model (``clip``).

With the ``prompt_answer`` text processor the model generates (a VLM: the answer, the caption or
the assistant's turns are labelled tokens); with another text processor a ``vqa`` row is a
classification sample: the question's tokens and the index of its answer in ``answer_processor``'s
vocabulary (a classifier such as ``concat_bert``). An image cell may be a ``datasets.Image``, raw
bytes, or a path (under ``image_folder``).
"""
from __future__ import annotations

import functools
import io
from pathlib import Path
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import Dataset

from mmvl.data.datasets._common import FileDatasetBuilder, data_path
from mmvl.data.datasets.image_files import verify_images, verify_requested
from mmvl.data.datasets.hf_access import GENERATED, READ, TASKS, arrow_row, image_cell, open_split, source_files
from mmvl.data.datasets.text_generation import ANSWER_PROCESSORS, GeneratesText, takes_images, visual_sample
from mmvl.data.processors import answers as _answers  # noqa: F401  (registers vqa_answer)
from mmvl.data.processors import image as _image  # noqa: F401  (registers torchvision_transforms)
from mmvl.data.processors import prompt_answer as _prompt_answer  # noqa: F401  (registers prompt_answer)
from mmvl.data.processors.answers import normalize_answer
from mmvl.errors import UserError
from mmvl.labels import IGNORE_INDEX
from mmvl.registry import register_dataset


def decode_cell(cell: Any, folder: Path, where: str, header: bool = False) -> Any:
    """An image cell (``{"bytes", "path"}``, bytes, or a path) -> an RGB PIL image; ``header``: its
    ``(width, height)`` alone, read from the header without decoding the pixels."""
    from PIL import Image

    data, path = image_cell(cell)
    try:
        with Image.open(io.BytesIO(data) if data is not None else folder / path) as img:
            if header:
                return tuple(img.size)
            img.load()
            return img.convert("RGB")
    except (OSError, ValueError) as e:
        shown = f"path {str(folder / path)!r}" if data is None else f"{len(data)} bytes"
        raise UserError(f"{where}: the image ({shown}) does not decode ({type(e).__name__}); check the image "
                        "column (columns.image / columns.images) and its files.") from None


def conversation_pairs(cell: Any, column: str, where: str) -> list[tuple[str, str]]:
    """A ``texts`` cell (the_cauldron's ``[{user, assistant}, ...]``) as ``(user, assistant)`` pairs.
    Anything else, or a pair without its answer (null, missing or blank: it would be trained as an
    empty reply), is refused in one line that names the row."""
    if cell is None:
        return []
    if isinstance(cell, Mapping):
        cell = [cell]
    if not isinstance(cell, (list, tuple)):
        raise UserError(f"{where}: column {column!r} holds a {type(cell).__name__} ({str(cell)[:40]!r}); the "
                        "conversation task reads a list of {user, assistant} pairs: map columns.texts to such a column.")
    pairs = []
    for k, pair in enumerate(cell):
        if not isinstance(pair, Mapping):
            raise UserError(f"{where}: {column}[{k}] is a {type(pair).__name__} ({str(pair)[:40]!r}), not a "
                            "{user, assistant} pair; map columns.texts to a column of such pairs (the_cauldron's texts).")
        user, answer = pair.get("user"), pair.get("assistant")
        if user is None or answer is None or not str(answer).strip():
            missing = "user" if user is None else "assistant"
            raise UserError(f"{where}: {column}[{k}] has no {missing} text (null, missing or blank); fill it or drop "
                            "the row: a conversation is trained on every answer.")
        pairs.append((str(user), str(answer)))
    return pairs


def image_cells(cell: Any) -> list[Any]:
    """An ``images`` cell as a list of image cells: a list as it is, one image a row as a list of one."""
    if cell is None:
        return []
    return list(cell) if isinstance(cell, (list, tuple)) else [cell]


class HFRows(Dataset):
    """The rows of one split as mmvl items (see the module docstring for each task)."""

    def __init__(self, data: Any, builder: "HFDatasetBuilder", split: str):
        self.data, self.builder, self.split = data, builder, split
        self.rows = data.with_format("arrow")  # a view of the same memory-mapped table
        self.columns, self.task = builder.columns, builder.task
        self.label = "all" if split == "train" else "last"

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, Any]:
        b, row = self.builder, arrow_row(self.rows, index)
        where = f"{b.name} {self.split} row {index}"
        item: dict[str, Any] = {"id": int(index)}
        images = self._images(row, where)
        image = images[0] if images else None
        pixels = functools.partial(visual_sample, b.text_processor, b.image_processor, images, where=where,
                                   blank=b.blank) if b.generative else None
        if self.task == "conversation":
            turns = self.turns(row, len(images), where)
            item.update(pixels(turns=turns, label=self.label))
            item["answer"] = turns[-1]["content"] if turns else ""
            return item
        if self.task == "caption":
            caption = self._text(row, "caption", where)
            item.update(pixels(prompt=b.caption_prompt, answer=caption), answer=caption)
            return item
        elif self.task == "contrastive":
            item.update(b.text_processor(self._text(row, "caption", where)))
        elif self.task == "classification":
            item.update(b.text_processor(self._text(row, "text", where)))
            item["targets"] = self._label(row, where)
        else:
            cell = row[self.columns["answer"]]
            answers = [self._checked(a, "answer", where)
                       for a in (cell if isinstance(cell, (list, tuple)) and cell else [cell])]
            question = self._text(row, "question", where)
            if b.generative:
                item.update(pixels(prompt=question, answer=answers[0]))
                item["answer"] = answers if len(answers) > 1 else answers[0]
                return item
            else:
                item.update(b.text_processor(question))
                item["targets"] = b.answer_processor.index.get(normalize_answer(answers[0]), IGNORE_INDEX)
        item["image"] = b.blank if image is None else b.image_processor(image)
        return item

    def turns(self, row: dict[str, Any], images: int, where: str) -> list[dict[str, str]]:
        """A conversation row's turns, one ``<image>`` per image ahead of its first user turn."""
        turns = []
        for k, (user, answer) in enumerate(conversation_pairs(row[self.columns["texts"]], self.columns["texts"], where)):
            head = "<image>" * images + "\n" if k == 0 and images else ""
            turns += [{"role": "user", "content": head + user}, {"role": "assistant", "content": answer}]
        return turns

    def check_fits(self, index: int) -> None:
        """Refuse row ``index`` at start if its image tokens would not fit (a processor that makes the
        pixels: their count follows each image's size, read from its header)."""
        b, row = self.builder, arrow_row(self.rows, index)
        where = f"{b.name} {self.split} row {index}"
        cells = image_cells(row[self.columns["images"]]) if self.task == "conversation" else [row[self.columns["image"]]]
        sizes = [decode_cell(cell, b.image_folder, where, header=True) for cell in cells]
        if self.task == "conversation":
            turns = self.turns(row, len(sizes), where)
        else:
            prompt = b.caption_prompt if self.task == "caption" else self._text(row, "question", where)
            key = "caption" if self.task == "caption" else "answer"
            cell = row[self.columns[key]]
            answer = self._checked(cell[0] if isinstance(cell, (list, tuple)) and cell else cell, key, where)
            turns = b.text_processor.prompt_turns(prompt, answer, len(sizes))
        b.text_processor.check_fits(turns, sizes, self.label, where)

    def _text(self, row: dict[str, Any], key: str, where: str) -> str:
        """The text cell of the task's ``key`` in ``row`` (see :meth:`_checked`)."""
        return self._checked(row[self.columns[key]], key, where)

    def _checked(self, value: Any, key: str, where: str) -> str:
        """``value`` of the task's ``key`` as text: a non-empty string (a number reads as its digits);
        null, blank, a list or a mapping is refused naming the row, where ``str()`` would train on
        ``'None'`` or a list's repr."""
        if isinstance(value, (str, int, float)) and not isinstance(value, bool) and str(value).strip():
            return str(value)
        raise UserError(f"{where}: column {self.columns[key]!r} ({key}) holds {type(value).__name__} {str(value)[:40]!r}; "
                        f"task {self.task} reads one non-empty text a row there: map columns.{key} to such a column.")

    def _label(self, row: dict[str, Any], where: str) -> int:
        """A class index (an int from 0), refused naming the row otherwise (null, a string, a float)."""
        value = row[self.columns["label"]]
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        raise UserError(f"{where}: column {self.columns['label']!r} (label) holds {value!r}; a classification label "
                        "is a class index (an integer from 0).")

    def _images(self, row: dict[str, Any], where: str) -> list[Any]:
        """The row's decoded images: the ``images`` list of a conversation (any number), else its one image."""
        if self.task == "conversation":
            return [decode_cell(cell, self.builder.image_folder, where) for cell in image_cells(row[self.columns["images"]])]
        return [decode_cell(row[self.columns["image"]], self.builder.image_folder, where)]


@register_dataset("hf_dataset")
class HFDatasetBuilder(GeneratesText, FileDatasetBuilder):
    """A Hugging Face dataset on disk; generative (``prompt_answer``) or a classifier's ``vqa``."""

    name = "hf_dataset"
    config_path = "datasets/hf_dataset.yaml"
    #: any text processor: prompt_answer for a generative model, another for a classifier or clip
    text_processor = FileDatasetBuilder.text_processor

    def __init__(self, config: Any, data_dir: str):
        super().__init__(config, data_dir)
        self.task = str(self.cfg.get("task") or "")
        if self.task not in TASKS:
            raise UserError(f"{self.name}: task={self.task!r}; use one of {', '.join(TASKS)}.")
        mapped = dict(self.cfg.get("columns") or {})
        unknown = sorted(set(mapped) - set(TASKS[self.task]))
        if unknown:
            raise UserError(f"{self.name}: columns {unknown} are not keys of task {self.task}; map its keys "
                            f"({', '.join(TASKS[self.task])}) to the dataset's columns.")
        self.columns = {**{k: k for k in TASKS[self.task]}, **{k: str(v) for k, v in mapped.items()}}
        self.caption_prompt = str(self.cfg.get("caption_prompt") or "describe the image")
        kind = ((self.cfg.get("processors") or {}).get("text_processor") or {}).get("type")
        self.generative = kind in ANSWER_PROCESSORS
        if not self.generative and self.task in GENERATED:
            raise UserError(f"{self.name}: task {self.task} writes text: its text_processor must be prompt_answer "
                            f"(or hf_processor for model hf_vlm; got {kind!r}).")
        if self.generative and self.task in READ:
            raise UserError(f"{self.name}: task {self.task} is read, not written: use a text processor such as "
                            f"{{type: vocab}} or {{type: bert_tokenizer}}, not {kind}.")
        self._data: dict[str, Any] = {}
        self._blank: torch.Tensor | None = None

    # -- the dataset's files ------------------------------------------------------------------
    def split_data(self, split: str) -> Any:
        """The split's ``datasets.Dataset`` (memory-mapped Arrow)."""
        if split not in self._data:
            cache = data_path(self.data_dir, None, self.cache_dir or Path(self.data_dir) / ".mmvl_cache") / "hf_dataset"
            self._data[split] = open_split(self.cfg, split, self.data_dir, str(cache), self.columns, self.task)
        return self._data[split]

    def check_split(self, split: str) -> None:
        source_files(self.cfg, split, self.data_dir)  # a split with no source: refused before any work

    def source_files(self, split: str) -> list[Path]:
        return source_files(self.cfg, split, self.data_dir)

    @property
    def image_folder(self) -> Path:
        folder = self.cfg.get("image_folder")
        return data_path(self.data_dir, None, folder) if folder else Path(self.data_dir)

    def records(self, split: str) -> Any:
        """The split, capped at ``max_samples`` (its first rows)."""
        if split not in self._records:
            data, cap = self.split_data(split), self.cfg.get("max_samples")
            self._records[split] = data.select(range(min(int(cap), len(data)))) if cap else data
        return self._records[split]

    def train_texts(self) -> list[str]:
        data, c = self.split_data("train").with_format("arrow"), self.columns
        data = {key: data[c[key]].to_pylist() for key in TASKS[self.task] if key not in ("image", "images")}
        if self.task == "conversation":
            column = self.columns["texts"]
            return [text for i, cell in enumerate(data["texts"])
                    for pair in conversation_pairs(cell, column, f"{self.name} train row {i}") for text in pair]
        if self.task in ("caption", "contrastive"):
            return [self.caption_prompt, *map(str, data["caption"])]
        if self.task == "classification":
            return [str(t) for t in data["text"]]
        answers = [a for cell in data["answer"] for a in (cell if isinstance(cell, list) else [cell])]
        return [*map(str, data["question"]), *map(str, answers)]

    def prepare_split(self, split: str) -> None:
        """Open the split, build the processors, and read its first row whole (an image column
        that does not decode is refused before any update)."""
        data = self.split_data(split)
        self.text_processor  # noqa: B018
        if self.task == "vqa" and not self.generative:
            self.answer_processor  # noqa: B018
        if len(data):
            rows = self.build(split)
            rows[0]
            if takes_images(self.text_processor):  # every row's image tokens fit, checked before any update
                for index in range(len(rows)):
                    rows.check_fits(index)
        if verify_requested(self.cfg, self.name):
            verify_images(self._image_decoders(self.records(split)), f"{self.name} {split}")

    def _image_decoders(self, data: Any, chunk: int = 256) -> Any:
        """``(row, decode)`` for every image cell of ``data``, read ``chunk`` rows at a time (never the
        whole column in memory)."""
        column = self.columns["images" if self.task == "conversation" else "image"]
        rows = data.with_format("arrow")
        for start in range(0, len(data), chunk):
            for offset, cell in enumerate(rows[start:start + chunk].column(column).to_pylist()):
                where = f"row {start + offset}"
                for image in (image_cells(cell) if self.task == "conversation" else [cell]):
                    yield where, functools.partial(decode_cell, image, self.image_folder, where)

    @property
    def answer_processor(self) -> Any:
        proc = self.processor("answer_processor", answers=lambda: [
            [str(a) for a in (cell if isinstance(cell, list) else [cell])]
            for cell in self.split_data("train").with_format("arrow")[self.columns["answer"]].to_pylist()])
        if proc is None:
            raise UserError(f"{self.name}: a classifier's vqa needs processors.answer_processor ({{type: vqa_answer}}).")
        return proc

    @property
    def blank(self) -> torch.Tensor:
        """The pixels of a text-only sample (zeros of the image processor's output size)."""
        if self._blank is None:
            from PIL import Image

            size = int(self.cfg.get("image_size") or 64)
            self._blank = torch.zeros_like(self.image_processor(Image.new("RGB", (size, size))))
        return self._blank

    def make_dataset(self, split: str, records: Any) -> Dataset:
        return HFRows(records, self, split)

    # -- what the model and the metrics read ---------------------------------------------------
    def collate(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        return GeneratesText.collate(self, items) if self.generative else FileDatasetBuilder.collate(self, items)

    def model_info(self) -> dict[str, int]:
        if self.generative:
            return self.text_processor.model_info()
        info = {"vocab_size": int(self.text_processor.vocab_size)}
        if self.task == "vqa":
            info["num_labels"] = self.answer_processor.num_answers
        elif self.task == "classification":
            info["num_labels"] = self.num_labels()
        return info

    def num_labels(self) -> int:
        """The label column's classes: its ``ClassLabel`` names, else the largest training label + 1."""
        data = self.split_data("train")
        feature = data.features[self.columns["label"]]
        names = getattr(feature, "names", None)
        if names:
            return len(names)
        labels = data.with_format("arrow")[self.columns["label"]].to_pylist()
        if not labels or any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in labels):
            raise UserError(f"{self.name}: the label column {self.columns['label']!r} must hold class indices "
                            "(integers from 0), as a ClassLabel or an int column.")
        return max(labels) + 1

    def generated_text(self, ids: Any) -> list[str]:
        if not self.generative:
            raise UserError(f"{self.name}: generated text needs the prompt_answer text processor.")
        return GeneratesText.generated_text(self, ids)

    def predictions(self, data: dict[str, Any], scores: Any) -> list[dict[str, Any]]:
        if self.generative:
            return GeneratesText.predictions(self, data, scores)
        ids = data["id"].tolist() if hasattr(data["id"], "tolist") else list(data["id"])
        best = torch.as_tensor(scores).argmax(-1).tolist()
        if self.task == "vqa":
            return [{"id": int(i), "answer": self.answer_processor.answer(a)} for i, a in zip(ids, best)]
        return [{"id": int(i), "label": int(a)} for i, a in zip(ids, best)]
