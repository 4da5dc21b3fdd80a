"""Sort-of-CLEVR (Santoro et al. 2017): a synthetic relational VQA task, generated on first use.

Each 75x75 image holds six non-overlapping objects of distinct colours, each a
circle or a square. Questions come in six types over the six colours:
non-relational (shape, left?, top?) and relational (shape of the closest /
furthest object, count of objects of the same shape). Scenes are resampled
until no closest/furthest answer is a tie, so every answer is unambiguous.

Files live in ``<data_dir>/sort_of_clevr/<hash of the generation params>/``:
``<split>.npz`` (``images`` uint8 NxHxWx3, ``centers`` Nx6x2 as (x, y),
``shapes`` Nx6 with 0 circle, 1 square), ``<split>_questions.json`` and a word
``vocab.txt`` (every word the question templates can produce). ``val`` and ``test`` are two separate held-out sets with their
own seeds, both disjoint from ``train`` by construction. A split's questions are parsed
once into a columnar table (:mod:`mmvl.data.records`: ``id``, ``image``, ``type``,
``color``, ``question``, ``answer``) cached beside the data (:mod:`mmvl.data.cache`).
"""
from __future__ import annotations

import hashlib
import json
import os
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig
from torch.utils.data import Dataset

from mmvl import io
from mmvl.config.components import build_component, component_spec
from mmvl.data.base import DatasetBuilder
from mmvl.data.datasets.sort_of_clevr_regions import object_regions
from mmvl.data.cache import Cache, default_root, fingerprint, load_table, make_key, save_table
from mmvl.data.records import Table
from mmvl.data.processors.text import SPECIAL_TOKENS, words_of, write_word_vocab
from mmvl.errors import UserError
from mmvl.registry import PROCESSORS, register_dataset

COLORS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255),
          "orange": (255, 156, 0), "gray": (128, 128, 128), "yellow": (255, 255, 0)}
COLOR_NAMES = list(COLORS)
SHAPES = ["circle", "square"]
ANSWERS = ["circle", "square", "yes", "no", "1", "2", "3", "4", "5", "6"]
TEMPLATES = [
    "what is the shape of the {} object?",
    "is the {} object on the left?",
    "is the {} object on the top?",
    "what is the shape of the object closest to the {} object?",
    "what is the shape of the object furthest from the {} object?",
    "how many objects have the same shape as the {} object?",
]
#: metric names of the question types (``accuracy/<name>``), in TEMPLATES order
TYPE_NAMES = ["shape", "left", "top", "closest", "furthest", "count"]
FAMILY_NAMES = ["non_relational", "relational"]
GENERATOR_VERSION = 1
SPLITS = ("train", "val", "test")
_TEXT = "dataset_config.sort_of_clevr.processors.text_processor"


def all_questions() -> list[str]:
    """Every question the generator can ask (6 types x 6 colours): the word vocabulary's source."""
    return [t.format(c) for t in TEMPLATES for c in COLOR_NAMES]


def render(xy: np.ndarray, shapes: np.ndarray, size: int, obj: int, background: int) -> np.ndarray:
    """Draw objects (centres ``xy`` as (x, y), shapes 0 circle / 1 square) in :data:`COLORS` order."""
    img = np.full((size, size, 3), background, dtype=np.uint8)
    ys, xs = np.ogrid[0:size, 0:size]
    for (x, y), shape, rgb in zip(xy, shapes, COLORS.values()):
        if shape == 0:
            mask = (xs - x) ** 2 + (ys - y) ** 2 <= obj * obj
        else:
            mask = (np.abs(xs - x) <= obj) & (np.abs(ys - y) <= obj)
        img[mask] = rgb
    return img


def sample_scene(rng: np.random.Generator, size: int, obj: int) -> tuple[np.ndarray, np.ndarray]:
    """Object centres and shapes, resampled until every closest/furthest answer is unambiguous."""
    lo, hi = obj, size - obj - 1
    while True:
        centers: list[tuple[int, int]] = []
        while len(centers) < len(COLORS):
            c = (int(rng.integers(lo, hi + 1)), int(rng.integers(lo, hi + 1)))
            # Chebyshev gap > 2*obj+1 keeps squares (and so circles) one pixel apart.
            if all(max(abs(c[0] - d[0]), abs(c[1] - d[1])) > 2 * obj + 1 for d in centers):
                centers.append(c)
        xy = np.array(centers, dtype=np.int64)
        d2 = ((xy[:, None, :] - xy[None, :, :]) ** 2).sum(-1)
        if all(len(set(np.delete(row, i).tolist())) == len(row) - 1 for i, row in enumerate(d2)):
            return xy, rng.integers(0, 2, size=len(COLORS)).astype(np.int64)


def answer(qtype: int, color: int, xy: np.ndarray, shapes: np.ndarray, size: int) -> int:
    """The index in :data:`ANSWERS` answering question ``qtype`` about the object of colour ``color``."""
    yes, no = ANSWERS.index("yes"), ANSWERS.index("no")
    if qtype == 0:
        return int(shapes[color])
    if qtype == 1:
        return yes if xy[color, 0] < size / 2 else no
    if qtype == 2:
        return yes if xy[color, 1] < size / 2 else no
    d2 = ((xy - xy[color]) ** 2).sum(-1)
    if qtype == 3:
        d2[color] = np.iinfo(np.int64).max
        return int(shapes[int(np.argmin(d2))])
    if qtype == 4:
        return int(shapes[int(np.argmax(d2))])
    return ANSWERS.index(str(int((shapes == shapes[color]).sum())))


def generate_split(num_images: int, questions_per_image: int, seed: int, size: int, obj: int,
                   background: int) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
    """Arrays and question records for one split; the same arguments give the same output."""
    rng = np.random.default_rng(seed)
    images = np.empty((num_images, size, size, 3), dtype=np.uint8)
    centers = np.empty((num_images, len(COLORS), 2), dtype=np.int64)
    shapes = np.empty((num_images, len(COLORS)), dtype=np.int64)
    n_rel = questions_per_image // 2
    n_non = questions_per_image - n_rel
    questions: list[dict[str, Any]] = []
    for i in range(num_images):
        centers[i], shapes[i] = sample_scene(rng, size, obj)
        images[i] = render(centers[i], shapes[i], size, obj, background)
        # Non-relational pairs are (type 0..2, colour), relational (type 3..5, colour): 18 each.
        picks = [int(p) for p in rng.permutation(18)[:n_non]] + [18 + int(p) for p in rng.permutation(18)[:n_rel]]
        for p in picks:
            qtype, color = p // 6, p % 6
            questions.append({
                "id": len(questions), "image": i, "type": qtype, "color": color,
                "question": TEMPLATES[qtype].format(COLOR_NAMES[color]),
                "answer": answer(qtype, color, centers[i], shapes[i], size),
            })
    return {"images": images, "centers": centers, "shapes": shapes}, questions


class SortOfClevrDataset(Dataset):
    """One split: items are dicts of a normalised image (or object regions), question tokens and the answer.

    With ``regions`` (see :func:`object_regions`) an item has ``features`` (6 x D, pixels in
    [0, 1]), ``boxes`` (6 x 4) and ``feature_mask`` (6) instead of ``image``.
    """

    def __init__(self, images: np.ndarray, questions: Table | list[dict[str, Any]], text_processor,
                 mean: list[float], std: list[float], regions: dict[str, np.ndarray] | None = None):
        self.images = None if regions else torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()  # uint8
        self.regions = None if not regions else {k: torch.from_numpy(v) for k, v in regions.items()}
        self.questions = questions if isinstance(questions, Table) else Table.from_rows(questions)
        questions = self.questions
        self.ids, self.image_rows = questions.column("id"), questions.column("image")
        self.types, self.answers = questions.column("type"), questions.column("answer")
        self.texts = questions.column("question")
        self.text_processor = text_processor
        std_t = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)
        self.scale = 1.0 / (255.0 * std_t)
        self.shift = -torch.tensor(mean, dtype=torch.float32).view(3, 1, 1) / std_t

    def __len__(self) -> int:
        return len(self.questions)

    def visual(self, image: int) -> dict[str, Any]:
        """The image's pixels, normalised, or its object regions."""
        if self.regions is None:
            return {"image": self.images[image].float() * self.scale + self.shift}
        feats = self.regions["features"][image]
        return {"features": feats.float() / 255.0, "boxes": self.regions["boxes"][image],
                "feature_mask": torch.ones(feats.shape[0], dtype=torch.long)}

    def __getitem__(self, index: int) -> dict[str, Any]:
        qtype = int(self.types[index])
        item: dict[str, Any] = self.visual(int(self.image_rows[index]))
        item.update(self.text_processor(self.texts[index]))
        item.update(targets=int(self.answers[index]), question_family=int(qtype >= 3), question_type=qtype,
                    id=int(self.ids[index]), image_id=int(self.image_rows[index]))
        return item


@register_dataset("sort_of_clevr")
class SortOfClevrBuilder(DatasetBuilder):
    """Generates Sort-of-CLEVR on first use and serves its ``train``/``val``/``test`` splits."""

    config_path = "datasets/sort_of_clevr.yaml"
    answer_vocab = ANSWERS

    def __init__(self, config: DictConfig, data_dir: str):
        super().__init__(config, data_dir)
        get = lambda key, default: config.get(key, default) if config is not None else default  # noqa: E731
        self.params = {
            "num_images": int(get("num_images", 10000)), "num_val_images": int(get("num_val_images", 500)),
            "num_test_images": int(get("num_test_images", 500)),
            "questions_per_image": int(get("questions_per_image", 20)), "seed": int(get("seed", 0)),
            "image_size": int(get("image_size", 75)), "object_size": int(get("object_size", 5)),
            "background": str(get("background", "white")), "version": GENERATOR_VERSION,
        }
        self.regions = get("regions", None)
        if self.regions not in (None, "crops"):
            raise UserError(f"sort_of_clevr: regions={self.regions!r}; use null (pixels) or 'crops' (object regions "
                            "cut at the generator's boxes).")
        self._check_params()
        self.mean = list(get("mean", [0.5, 0.5, 0.5]))
        self.std = list(get("std", [0.5, 0.5, 0.5]))
        digest = hashlib.sha1(json.dumps(self.params, sort_keys=True).encode()).hexdigest()[:10]
        self.root = Path(os.path.expanduser(str(data_dir))) / "sort_of_clevr" / digest
        self._processor = None
        self._questions: dict[str, Table] = {}

    def _check_params(self) -> None:
        p = self.params
        if not 1 <= p["questions_per_image"] <= 36:
            raise UserError(f"sort_of_clevr: questions_per_image={p['questions_per_image']} must be in 1..36 "
                            "(6 question types x 6 colours).")
        if p["background"] not in ("white", "black"):
            raise UserError(f"sort_of_clevr: background={p['background']!r}; use 'white' or 'black'.")
        for key in ("num_images", "num_val_images", "num_test_images"):
            if p[key] < 1:
                raise UserError(f"sort_of_clevr: {key}={p[key]} must be at least 1.")
        if (2 * p["object_size"] + 2) * 3 > p["image_size"]:
            raise UserError(f"sort_of_clevr: object_size={p['object_size']} is too large for image_size="
                            f"{p['image_size']}; six objects must fit without overlapping.")

    # -- files ---------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Generate all splits into a temp folder, then publish it whole (crash-safe, idempotent).

        A published folder whose files no longer match its marker (cut short, edited) is refused,
        not used: generated data is never repaired in place, the fix is to delete it."""
        problem = io.completeness_problem(self.root)
        if problem is None:
            return
        if (self.root / io.MARKER).is_file():
            raise UserError(f"sort_of_clevr: the generated data in {str(self.root)!r} is damaged ({problem}); "
                            "delete that folder to regenerate it.")
        if (self.root / "meta.json").is_file():  # generated by mmvl before the marker: renamed whole, so complete
            io.mark_complete(self.root)
            return
        try:
            self.root.parent.mkdir(parents=True, exist_ok=True)
            tmp = io.make_temp_dir(self.root.parent)
        except OSError as e:  # the nearest folder that exists is the one that refused
            where = next(p for p in (self.root.parent, *self.root.parent.parents) if p.exists())
            raise UserError(f"sort_of_clevr: cannot write the generated data into {str(where)!r} "
                            f"({e.strerror}); make it writable, or set env.data_dir to a writable folder.") from None
        try:
            self._generate(tmp)
        except BaseException:
            io.remove_tree(tmp)
            raise
        io.publish_dir(tmp, self.root)  # False: another process finished first; its copy is identical

    def _generate(self, tmp: Path) -> None:
        p = self.params
        bg = 255 if p["background"] == "white" else 0
        counts = {"train": p["num_images"], "val": p["num_val_images"], "test": p["num_test_images"]}
        for offset, split in enumerate(SPLITS):
            arrays, questions = generate_split(counts[split], p["questions_per_image"], p["seed"] * 3 + offset,
                                               p["image_size"], p["object_size"], bg)
            np.savez(tmp / f"{split}.npz", **arrays)
            (tmp / f"{split}_questions.json").write_text(json.dumps(questions), encoding="utf-8")
        write_word_vocab(all_questions(), tmp / "vocab.txt")
        (tmp / "meta.json").write_text(json.dumps({"params": p, "answers": ANSWERS}, indent=1))

    def _damaged(self, path: Path, err: Exception) -> UserError:
        return UserError(f"sort_of_clevr: generated file {str(path)!r} does not read ({type(err).__name__}: "
                         f"{str(err)[:80]}); delete the folder {path.parent.name!r} to regenerate it.")

    def _arrays(self, split: str, *names: str) -> list[np.ndarray]:
        """Arrays ``names`` of ``<split>.npz`` (no pickle); an unreadable file is a UserError naming it."""
        path = self._require(f"{split}.npz")
        try:
            with np.load(path, allow_pickle=False) as arrays:
                return [arrays[name] for name in names]
        except (zipfile.BadZipFile, ValueError, KeyError, EOFError, OSError) as e:
            raise self._damaged(path, e) from None

    def _require(self, name: str) -> Path:
        path = self.root / name
        if not path.is_file():
            raise UserError(f"sort_of_clevr: {str(path)!r} is missing; run prepare() first (mmvl_run does) "
                            "or delete the folder to regenerate it.")
        return path

    def questions(self, split: str) -> Table:
        """The split's questions as a table, memory-mapped from the cache (parsed on first use)."""
        if split not in SPLITS:
            raise UserError(f"sort_of_clevr: unknown split {split!r}; use one of {', '.join(SPLITS)}.")
        if split not in self._questions:
            path = self._require(f"{split}_questions.json")
            cache = Cache(default_root(self.cache_dir, self.data_dir), "sort_of_clevr")

            def build(folder: Path) -> None:
                try:
                    rows = json.loads(path.read_text("utf-8"))
                except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                    raise self._damaged(path, e) from None
                save_table(folder, "questions", Table.from_rows(rows) if rows else Table({}))

            self._questions[split] = cache.get(f"{split}.{make_key(str(path))[:8]}", make_key(fingerprint([path])),
                                               build, lambda folder: load_table(folder, "questions"),
                                               f"{split} questions")
        return self._questions[split]

    def prepare_split(self, split: str) -> None:
        self.questions(split)

    # -- contract ------------------------------------------------------------------------------
    def _tokenizer_spec(self) -> tuple[str, dict[str, Any]]:
        return component_spec((self.config.get("processors") or {}).get("text_processor") or "bert_tokenizer", _TEXT)

    @property
    def text_processor(self):
        """The configured text processor; a null ``tokenizer_path`` means the generated word ``vocab.txt``."""
        if self._processor is None:
            kind, params = self._tokenizer_spec()
            self._processor = build_component(PROCESSORS, {"type": kind, "params": params}, where=_TEXT,
                                              defaults={"tokenizer_path": lambda: str(self._require("vocab.txt"))})
        return self._processor

    def build(self, split: str) -> Dataset:
        questions = self.questions(split)
        images, centers = self._arrays(split, "images", "centers")
        regions = None
        if self.regions == "crops":
            p = self.params
            regions = object_regions(images, centers, p["object_size"], 255 if p["background"] == "white" else 0,
                                     seed=p["seed"] * 3 + SPLITS.index(split) + 1000)
        return SortOfClevrDataset(images, questions, self.text_processor, self.mean, self.std, regions)

    def scenes(self, split: str) -> dict[str, np.ndarray]:
        """``split``'s object centres (N x 6 x 2, (x, y) in pixels) and shapes (N x 6), e.g. for probes."""
        centers, shapes = self._arrays(split, "centers", "shapes")
        return {"centers": centers, "shapes": shapes}

    def model_info(self) -> dict[str, int]:
        """Values the model config leaves null: ``vocab_size``, ``num_labels`` and, with regions,
        ``feature_dim`` (no files needed)."""
        if self._processor is None and self._tokenizer_spec()[1].get("tokenizer_path") is None:
            vocab_size = len(SPECIAL_TOKENS) + len(words_of(all_questions()))  # what prepare() writes
        else:
            vocab_size = int(self.text_processor.vocab_size)
        info = {"vocab_size": vocab_size, "num_labels": len(ANSWERS)}
        if self.regions == "crops":  # the width of the served region features
            info["feature_dim"] = (2 * self.params["object_size"] + 3) ** 2 * 3
        return info

    def prior_answers(self) -> dict[int, int]:
        """Most frequent training answer per question type (ties go to the lower answer index)."""
        counts: dict[int, Counter] = {t: Counter() for t in range(len(TEMPLATES))}
        for q in self.questions("train"):
            counts[q["type"]][q["answer"]] += 1
        return {t: min(c, key=lambda a: (-c[a], a)) for t, c in counts.items() if c}

    def extra_metrics(self, split: str) -> dict[str, float]:
        """What answering each question type with its most frequent training answer scores on ``split``.

        ``accuracy/prior`` overall, ``accuracy/prior/<family>`` and ``accuracy/prior/<type>``: the
        reference each ``accuracy/...`` metric must beat to show that the model read the image.
        """
        prior = self.prior_answers()
        hits: dict[str, list[int]] = {"": [], **{f"/{n}": [] for n in FAMILY_NAMES + TYPE_NAMES}}
        for q in self.questions(split):
            hit = int(prior.get(q["type"]) == q["answer"])
            for name in ("", f"/{FAMILY_NAMES[int(q['type'] >= 3)]}", f"/{TYPE_NAMES[q['type']]}"):
                hits[name].append(hit)
        return {f"accuracy/prior{name}": sum(h) / max(1, len(h)) for name, h in hits.items() if h or not name}
