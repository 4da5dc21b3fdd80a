"""``llava``: LLaVA's instruction data, conversations about an image (or none) for a generative VLM.

The files are LLaVA's JSON (``annotations.<split>``): a list of ``{"id", "image", "conversations":
[{"from": "human" | "gpt", "value"}, ...]}``; ``image`` is a path under ``image_folder`` and a
record without it is text-only; the ``<image>`` placeholder sits in one human turn. Turns become
``user``/``assistant`` messages for the ``prompt_answer`` text processor, which renders them through
the tokenizer's chat template where its folder has one (:mod:`mmvl.data.processors.chat`).

``train`` labels every assistant turn. ``val`` and ``test`` label only each conversation's last
assistant turn, which is also the sample's reference (``answer``): evaluation generates that turn
from the conversation before it and the generation metrics score it.

Every record is checked when its split is parsed, before any training: the turns (human first,
alternating), the placeholder (one exactly when there is an image), that its image file exists,
and, with ``on_too_long: error``, its length with the image tokens in.
"""
from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from mmvl.data.datasets._common import FileDatasetBuilder, data_path
from mmvl.data.datasets.image_files import decode_image, image_size, verify_images, verify_requested
from mmvl.data.datasets.text_generation import GeneratesText, takes_images, visual_sample
from mmvl.data.processors import image as _image  # noqa: F401  (registers torchvision_transforms)
from mmvl.data.processors import prompt_answer as _prompt_answer  # noqa: F401  (registers prompt_answer)
from mmvl.data.processors.chat import check_turns
from mmvl.data.records import Strings, Table
from mmvl.errors import UserError
from mmvl.registry import register_dataset

log = logging.getLogger("mmvl")
#: LLaVA's speakers -> chat roles
ROLES = {"human": "user", "gpt": "assistant", "user": "user", "assistant": "assistant"}
SPLITS = ("train", "val", "test")


def image_paths(image: Any, where: str) -> list[str]:
    """A record's ``image``: none, one path, or a list of paths (several images, one ``<image>`` each)."""
    paths = [image] if isinstance(image, str) else image if isinstance(image, list) else None
    if image is None or image == "":
        return []
    if not paths or not all(isinstance(p, str) and p and "\n" not in p for p in paths):
        raise UserError(f"{where}: image={image!r}; give a path under image_folder, or a list of them.")
    return paths


def stored_paths(cell: str) -> list[str]:
    """A table's ``image`` cell as its paths (one a line; "" for a text-only sample)."""
    return cell.split("\n") if cell else []


def label_of(split: str) -> str:
    """``train`` labels every assistant turn; ``val`` and ``test`` the last, which evaluation generates."""
    return "all" if split == "train" else "last"


def parse_llava(path: Path, name: str = "llava") -> Table:
    """A LLaVA JSON file as a table: ``sample_id``, ``image`` (its paths a line each, "" for text-only)
    and ``turns`` (the conversation as JSON ``[{"role", "content"}]``); every record checked, errors
    naming it."""
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{name}: {str(path)!r} cannot be read ({type(e).__name__}); check "
                        f"dataset_config.{name}.annotations.") from None
    except ValueError as e:
        raise UserError(f"{name}: {str(path)!r} is not valid JSON ({str(e)[:80]}); the file may be truncated.") from None
    if not isinstance(records, list):
        raise UserError(f"{name}: {str(path)!r} holds a {type(records).__name__}; LLaVA's format is a JSON list of "
                        "{id, image, conversations} records.")
    ids, images, turns = [], [], []
    for i, record in enumerate(records):
        sample = record.get("id", i) if isinstance(record, dict) else i
        where = f"{name}: {path.name} sample {sample!r}"
        if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
            raise UserError(f"{where} (record {i}) has no 'conversations' list; each record is "
                            "{id, image, conversations: [{from, value}, ...]}.")
        messages = []
        for turn in record["conversations"]:
            role = ROLES.get(turn.get("from")) if isinstance(turn, dict) else None
            if role is None or not isinstance(turn.get("value"), str):
                raise UserError(f"{where}: turn {turn!r} is not {{from: human | gpt, value: text}}.")
            messages.append({"role": role, "content": turn["value"]})
        paths = image_paths(record.get("image"), where)
        check_turns(messages, len(paths), "<image>", where)
        ids.append(str(sample))
        images.append("\n".join(paths))
        turns.append(json.dumps(messages))
    return Table({"sample_id": Strings.build(ids), "image": Strings.build(images), "turns": Strings.build(turns)})


class LlavaDataset(Dataset):
    """Items: ``id`` (row), ``sample_id`` (LLaVA's id), the conversation's tokens, ``image`` (zeros
    for text-only samples: the model places image tokens only where a sample has placeholders),
    ``answer`` (the last assistant turn)."""

    def __init__(self, records: Table, folder: Path, text_processor: Any, image_processor: Any, label: str,
                 blank: torch.Tensor, name: str):
        self.records, self.folder, self.label, self.blank, self.name = records, folder, label, blank, name
        self.text_processor, self.image_processor = text_processor, image_processor

    def __len__(self) -> int:
        return len(self.records)

    def sample_lengths(self) -> list[int]:
        """About each conversation's tokens (``training.group_by_length``)."""
        return [self.text_processor.length([t["content"] for t in json.loads(turns)], len(stored_paths(image)))
                for turns, image in zip(self.records.column("turns"), self.records.column("image"))]

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample, image = self.records.column("sample_id")[index], self.records.column("image")[index]
        turns = json.loads(self.records.column("turns")[index])
        item: dict[str, Any] = {"id": index, "sample_id": sample, "answer": turns[-1]["content"]}
        images = [self.decoded(path, sample) for path in stored_paths(image)]
        item.update(visual_sample(self.text_processor, self.image_processor, images, turns=turns, label=self.label,
                                  where=f"{self.name} sample {sample!r}", blank=self.blank))
        return item

    def decoded(self, image: str, sample: str) -> Any:
        path = self.folder / image
        try:
            return decode_image(path)
        except (OSError, ValueError) as e:
            raise UserError(f"{self.name} sample {sample!r}: image {str(path)!r} cannot be decoded "
                            f"({type(e).__name__}); replace the file.") from None


@register_dataset("llava")
class LlavaBuilder(GeneratesText, FileDatasetBuilder):
    """LLaVA JSON conversations; predictions ``[{"id": LLaVA's id, "answer", "reference"}]``."""

    name = "llava"
    config_path = "datasets/llava.yaml"

    def check_split(self, split: str) -> None:
        if not (self.cfg.get("annotations") or {}).get(split):
            raise UserError(f"{self.name}: annotations.{split} is not set, and the run uses the {split} split; set "
                            f"dataset_config.{self.name}.annotations.{split} to a LLaVA JSON file or change run_type.")

    def source_files(self, split: str) -> list[Path]:
        self.check_split(split)
        path = data_path(self.data_dir, None, self.cfg["annotations"][split])
        if not path.is_file():
            raise UserError(f"{self.name}: annotations.{split}={str(path)!r} does not exist; give a LLaVA JSON file.")
        return [path]

    @property
    def image_folder(self) -> Path:
        folder = self.cfg.get("image_folder")
        return data_path(self.data_dir, None, folder) if folder else Path(self.data_dir)

    def load_records(self, split: str) -> Table:
        return parse_llava(self.source_files(split)[0], self.name)

    def train_texts(self) -> list[str]:
        return [t["content"].replace("<image>", " ") for turns in self.records("train").column("turns").tolist()
                for t in json.loads(turns)]

    def prepare_split(self, split: str) -> None:
        """Parse the split, then check what the parse cannot: every image file is there (with
        ``verify_images``, that each decodes) and, under ``on_too_long: error``, every sample fits."""
        records = self.records(split)
        processor = self.text_processor
        folder = self.image_folder
        first: dict[str, Any] = {}  # image -> the first sample showing it
        for sample, paths in zip(records.column("sample_id").tolist(), records.column("image").tolist()):
            for image in stored_paths(paths):
                if not (folder / image).is_file():
                    raise UserError(f"{self.name} {split} sample {sample!r}: image {str(folder / image)!r} does not "
                                    f"exist; check dataset_config.{self.name}.image_folder.")
                first.setdefault(image, sample)
        if verify_requested(self.cfg, self.name):
            verify_images(((f"sample {sample!r}: {str(folder / image)!r}", functools.partial(decode_image, folder / image))
                           for image, sample in first.items()), f"{self.name} {split}")
        if takes_images(processor):  # every sample's image tokens fit (their count follows each image's size)
            for sample, paths, turns in zip(records.column("sample_id").tolist(), records.column("image").tolist(),
                                            records.column("turns").tolist()):
                where = f"{self.name} {split} sample {sample!r}"
                sizes = [image_size(folder / p, where) for p in stored_paths(paths)]
                processor.check_fits(json.loads(turns), sizes, label_of(split), where)
        elif getattr(processor, "on_too_long", None) == "error":
            for row in range(len(records)):
                turns = json.loads(records.column("turns")[row])
                processor.conversation(turns, len(stored_paths(records.column("image")[row])), label_of(split),
                                       f"{self.name} {split} sample {records.column('sample_id')[row]!r}")

    def make_dataset(self, split: str, records: Table) -> Dataset:
        size = int(self.cfg.get("image_size") or 64)
        from PIL import Image

        blank = self.image_processor(Image.new("RGB", (size, size)))
        return LlavaDataset(records, self.image_folder, self.text_processor, self.image_processor,
                            label_of(split), torch.zeros_like(blank), self.name)

    def predictions(self, data: dict[str, Any], scores: Any) -> list[dict[str, Any]]:
        rows = super().predictions(data, scores)
        for row, sample in zip(rows, data["sample_id"]):
            row["id"] = sample
        return rows


__all__ = ["LlavaBuilder", "parse_llava"]
