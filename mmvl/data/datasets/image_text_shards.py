"""Image-text pairs from WebDataset shards (CC3M, CC12M, LAION as img2dataset writes them), as
image-text matching with optional masked LM: the pretraining task of ``coco_captions``, at scale.

``train`` streams its shards (:mod:`mmvl.data.shard_stream`: split over ranks and workers, a
shuffle buffer, exact resume). An item pairs its image with its own caption (``targets`` 1) or,
with probability ``negative_ratio``, with the caption of another sample of the same batch
(``targets`` 0); masking and negatives are drawn from ``(seed, epoch, shard, offset)``, never from
a worker's RNG. ``val``/``test`` shards are read by position (tar member offsets, one file read
per item), so evaluation is a plain map-style dataset in a fixed order with fixed negatives.

A corrupt image is skipped and counted in the log (the batch is one smaller); a missing shard is
one error naming it.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from mmvl.data.datasets.coco_captions import COCOCaptionsBuilder, contrastive_ratio
from mmvl.data.processors.image import TorchvisionTransforms
from mmvl.data.shard_stream import ShardSource
from mmvl.data import shards as sh
from mmvl.errors import UserError
from mmvl.registry import register_dataset

log = logging.getLogger("mmvl")
_PIXELS = TorchvisionTransforms()  # float C x H x W in [0, 1] when no image_processor is set


class SampleMaker:
    """Decodes raw samples into items; counts the images it had to skip (per process)."""

    def __init__(self, name: str, text_processor: Any, image_processor: Any, negative_ratio: float, seed: int,
                 mask: bool, collate: Any, firsts: np.ndarray, label_names: list[str] | None = None):
        self.name, self.text_processor, self.image_processor = name, text_processor, image_processor
        self.label_names = label_names or []
        self.label_patterns = [re.compile(r"\b" + re.escape(n) + r"\b", re.IGNORECASE) for n in self.label_names]
        self.negative_ratio, self.seed, self.mask, self.collate = negative_ratio, seed, mask, collate
        self.firsts, self.skipped = firsts, 0

    def decode(self, shard: int, offset: int, raw: dict[str, Any]) -> tuple[Any, str] | None:
        try:
            return (self.image_processor or _PIXELS)(sh.decode_sample_image(raw)), sh.caption_of(raw)
        except (OSError, ValueError, UnicodeDecodeError, SyntaxError) as e:
            self.skipped += 1
            log.warning("%s: skipped corrupt sample %r of shard %s (%s); %d skipped so far in this process",
                        self.name, raw.get("__key__"), shard, e, self.skipped)
            return None

    def label_of(self, caption: str) -> int:
        """The index of the one ``label_names`` entry that ``caption`` names (as a whole word)."""
        found = [i for i, p in enumerate(self.label_patterns) if p.search(caption)]
        if len(found) != 1:
            raise UserError(f"{self.name}: label_names: caption {caption!r} names {len(found)} of "
                            f"{self.label_names}; each caption must name exactly one (or set label_names: null).")
        return found[0]

    def item(self, uid: int, image: Any, caption: str, target: int, rng: list[int] | None,
             own_caption: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": uid, "image": image, "targets": target}
        if self.label_patterns:  # the class the image's own caption names (zero-shot evaluation reads it)
            out["label"] = self.label_of(caption if own_caption is None else own_caption)
        out.update(self.text_processor(caption, rng=rng) if rng is not None else self.text_processor(caption))
        return out

    def __call__(self, raws: list[tuple[int, int, dict[str, Any]]], epoch: int) -> dict[str, Any] | None:
        """One training batch: the decodable samples of ``raws`` with in-batch negatives."""
        kept = [(s, o, d) for s, o, raw in raws if (d := self.decode(s, o, raw)) is not None]
        if not kept:
            return None
        n, items = len(kept), []
        for i, (s, o, (image, _)) in enumerate(kept):
            rng = np.random.default_rng([self.seed, epoch, s, o])
            partner = i
            if n > 1 and rng.random() < self.negative_ratio:
                partner = (i + 1 + int(rng.integers(n - 1))) % n
            mask = [self.seed, epoch, s, o, 1] if self.mask else None
            items.append(self.item(int(self.firsts[s]) + o, image, kept[partner][2][1], int(partner == i), mask,
                                   kept[i][2][1]))
        return self.collate(items)


class ShardIndexDataset(Dataset):
    """An evaluation split: samples read by their tar offsets, negatives fixed by ``(seed, index)``."""

    def __init__(self, paths: list[Path], maker: SampleMaker, split_salt: int):
        self.paths, self.maker, self.salt = paths, maker, split_salt
        rows = []  # (shard, image offset, image size, text offset, text size, text ext is json)
        for s, path in enumerate(paths):
            for members in sh.members_by_key(path, maker.name):
                image = next((m for e, m in members.items() if e in sh.IMAGE_EXTS), None)
                text = members.get("txt") or members.get("json")
                if image is not None and text is not None:
                    rows.append((s, image.offset_data, image.size, text.offset_data, text.size,
                                 int("txt" not in members)))
        self.rows = np.asarray(rows, dtype=np.int64).reshape(-1, 6)

    def __len__(self) -> int:
        return len(self.rows)

    def _read(self, index: int) -> dict[str, Any]:
        s, io_, isz, to, tsz, is_json = (int(v) for v in self.rows[index])
        with open(self.paths[s], "rb") as f:
            f.seek(io_)
            image = f.read(isz)
            f.seek(to)
            text = f.read(tsz)
        return {"__key__": f"{index}", "png": image, "json" if is_json else "txt": text}

    def __getitem__(self, index: int) -> dict[str, Any]:
        n = len(self.rows)
        for step in range(n):  # a corrupt image: serve the next sample (counted in the log)
            row = (index + step) % n
            got = self.maker.decode(int(self.rows[row, 0]), row, self._read(row))
            if got is None:
                continue
            rng = np.random.default_rng([self.maker.seed, self.salt, row])
            partner = row
            if n > 1 and rng.random() < self.maker.negative_ratio:
                partner = (row + 1 + int(rng.integers(n - 1))) % n
            caption = got[1] if partner == row else sh.caption_of(self._read(partner))
            return self.maker.item(row, got[0], caption, int(partner == row), None, got[1])
        raise UserError(f"{self.maker.name}: no image of {[str(p) for p in self.paths]} decodes; write the shards again.")


@register_dataset("image_text_shards")
class ImageTextShardsBuilder(COCOCaptionsBuilder):
    """Image-text matching (+ masked LM) over shards; ``num_labels`` 2, like ``coco_captions``."""

    name = "image_text_shards"
    config_path = "datasets/image_text_shards.yaml"

    def shard_paths(self, split: str) -> list[Path]:
        spec = self.split_config(split).get("shards")
        return sh.expand_shards(spec, self.path, self.name, f"dataset_config.{self.name}.splits.{split}.shards")

    def source_files(self, split: str) -> list[Path]:
        return self.shard_paths(split)

    def prepare_split(self, split: str) -> None:
        self.shard_paths(split)  # a missing shard fails here, on rank 0, before anything starts
        self.text_processor  # noqa: B018

    def train_texts(self) -> list[str]:
        """The training captions (only for a text processor that builds its vocabulary from them)."""
        return [sh.caption_of(raw) for path in self.shard_paths("train") for raw in sh.raw_samples(path)]

    def maker(self, split: str) -> SampleMaker:
        ratio = contrastive_ratio(self.cfg, self.name)
        masking = float(getattr(self.text_processor, "mask_probability", 0.0) or 0.0) > 0
        mask = masking and (split == "train" or bool(self.cfg.get("mask_eval", False)))
        paths = self.shard_paths(split)
        counts = [sh.count_samples(p, self.name) for p in paths]
        names = self.cfg.get("label_names")
        return SampleMaker(self.name, self.text_processor, self.image_processor, ratio, int(self.cfg.get("seed", 0)),
                           mask, self.collate, np.cumsum([0] + counts), [str(n) for n in names or []])

    def build(self, split: str) -> Dataset:
        if split in self._datasets:
            return self._datasets[split]
        maker, paths = self.maker(split), self.shard_paths(split)
        if split == "train":
            counts = np.diff(maker.firsts).tolist()
            buffer = int(self.cfg.get("shuffle_buffer", 1000))
            if buffer < 1:
                raise UserError(f"{self.name}: shuffle_buffer={buffer} must be at least 1 (1: no shuffling "
                                "within a worker's shards).")
            dataset: Dataset = ShardSource(self.name, paths, counts, buffer, maker)
        else:
            dataset = ShardIndexDataset(paths, maker, {"val": 1, "test": 2}.get(split, 3))
        self._datasets[split] = dataset
        return dataset

    def model_info(self) -> dict[str, int]:
        return {"vocab_size": int(self.text_processor.vocab_size), "num_labels": 2}
