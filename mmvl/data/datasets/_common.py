"""Shared loading for the file-based vision-and-language datasets (VQA v2, COCO, Hateful Memes).

Every problem a user can cause (a wrong path, a truncated download, a record
without a field, an unreadable image) becomes a one-line :class:`UserError`
naming the file and what is wrong, instead of a ``KeyError`` deep in a worker.

A split's samples are a columnar :class:`~mmvl.data.records.Table` (no Python object per
sample, so DataLoader workers do not copy them), parsed once and then memory-mapped from
the preprocessing cache (:mod:`mmvl.data.cache`); processors fitted on the training split
(word and answer vocabularies) are cached there too.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np

from omegaconf import DictConfig, OmegaConf
from torch.utils.data import Dataset

from mmvl.data.datasets.image_files import check_policy, decode_image, readable_rows
from mmvl.config.access import plain
from mmvl.config.components import accepts, build_component, component_spec
from mmvl.data import jsonstream
from mmvl.data.base import DatasetBuilder
from mmvl.data.cache import Cache, default_root, fingerprint, load_tables, make_key, save_tables
from mmvl.data.processors.image import TorchvisionTransforms
from mmvl.data.records import Table
from mmvl.errors import UserError
from mmvl.registry import PROCESSORS

log = logging.getLogger("mmvl")

_PLAIN_PIXELS = TorchvisionTransforms()  # float C x H x W in [0, 1] when no image_processor is set


def data_path(data_dir: str, folder: str | None, path: str | os.PathLike) -> Path:
    """``path`` as given when absolute, else under ``<data_dir>/<folder>``."""
    p = Path(os.path.expanduser(str(path)))
    if p.is_absolute():
        return p
    base = Path(os.path.expanduser(str(data_dir)))
    return base / folder / p if folder else base / p


def _require_file(path: Path, dataset: str, what: str) -> None:
    if not path.is_file():
        hint = "it is a folder" if path.is_dir() else "it does not exist"
        raise UserError(f"{dataset}: {what} {str(path)!r} cannot be read ({hint}); check env.data_dir and "
                        f"dataset_config.{dataset} paths, or download the official files there.")


def stream_json(path: Path, keys: tuple[str, ...], dataset: str,
                what: str = "annotation file") -> Iterator[tuple[str, int, Any]]:
    """``(key, index, element)`` of the top-level arrays ``keys``, one element in memory at a time;
    every problem (a missing file, invalid JSON, a missing or non-list field) is a one-line UserError naming it."""
    _require_file(path, dataset, what)
    try:
        yield from jsonstream.iter_arrays(path, keys)
    except jsonstream.JSONStreamError as e:
        raise UserError(f"{dataset}: {what} {str(path)!r} is not valid JSON (line {e.lineno}, column {e.colno}: "
                        f"{e.msg}); the file may be truncated, download it again.") from None
    except jsonstream.NotAnArray as e:
        raise UserError(f"{dataset}: {str(path)!r} field {e.key!r} must be a list, got {e.found}.") from None
    except KeyError as e:
        key, found = e.args[0], e.args[1][:5] if len(e.args) > 1 else []
        raise UserError(f"{dataset}: {str(path)!r} has no top-level {key!r} field (found {found}); "
                        "is it the right file for this split?") from None
    except (UnicodeDecodeError, OSError) as e:
        raise UserError(f"{dataset}: {what} {str(path)!r} cannot be read ({e}); download it again.") from None


def int_id(value: Any, path: Path, dataset: str, where: str) -> int:
    """An integer id (``question_id``, ``image_id``...); anything else is a UserError naming the record."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{dataset}: {str(path)!r} {where} is {value!r}; ids must be integers as in the "
                        "official files.")
    return value


def load_jsonl(path: Path, dataset: str, what: str = "annotation file") -> list[dict[str, Any]]:
    """One JSON object per line (blank lines ignored); errors name the line number."""
    _require_file(path, dataset, what)
    records = []
    try:
        with open(path, "r", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UserError(f"{dataset}: {what} {str(path)!r} line {lineno} is not valid JSON ({e.msg}); "
                                    "fix or re-download the file.") from None
                if not isinstance(record, dict):
                    raise UserError(f"{dataset}: {what} {str(path)!r} line {lineno} is a "
                                    f"{type(record).__name__}, expected a JSON object.")
                record["_line"] = lineno
                records.append(record)
    except UnicodeDecodeError as e:
        raise UserError(f"{dataset}: {what} {str(path)!r} is not UTF-8 text ({e.reason}).") from None
    return records


def require_fields(record: Any, fields: Iterable[str], path: Path, dataset: str, where: str) -> None:
    """Raise naming ``path``, the record (``where``: "line 3", "annotations[5]") and the first missing field."""
    if not isinstance(record, dict):
        raise UserError(f"{dataset}: {str(path)!r} {where} is a {type(record).__name__}, expected an object.")
    for name in fields:
        if name not in record:
            raise UserError(f"{dataset}: {str(path)!r} {where} has no {name!r} field (it has {sorted(record)}); "
                            "the file does not follow the official format.")


def build_processor(spec: Any, dataset: str, key: str, **extra: Any) -> Any:
    """``{type, params}`` -> a registered processor; ``extra`` fills params the spec leaves unset/null.

    An ``extra`` key the processor does not accept is dropped, so builders can
    offer e.g. the training texts to any text processor (see
    :func:`mmvl.config.components.bind_params`).
    """
    return build_component(PROCESSORS, spec, where=f"dataset_config.{dataset}.processors.{key}", defaults=extra)


# -- images ------------------------------------------------------------------------------------
class ImageLoading:
    """Mixin for datasets whose items hold ``image`` (transformed pixels) or region ``features``.

    Subclasses set ``dataset``, ``records`` (a :class:`~mmvl.data.records.Table`), ``policy``,
    ``image_processor``, ``features_processor`` and implement ``image_path(row)`` /
    ``feature_key(row)`` and ``make_item(row)``, reading the table's column arrays (never
    a per-sample Python object). A decode failure under ``skip`` serves the next readable
    sample and logs the running count of skipped images.
    """

    dataset: str
    records: Table
    policy: str
    image_processor: Any
    features_processor: Any
    skipped: int = 0

    def image_path(self, row: int) -> Path:  # pragma: no cover - abstract
        raise NotImplementedError

    def feature_key(self, row: int) -> str:
        return self.image_path(row).stem

    def visual_inputs(self, row: int) -> dict[str, Any] | None:
        """``{"image": tensor}`` or ``{"features", "boxes", "feature_mask", ...}``; None if skipped."""
        if self.features_processor is not None:
            sample = dict(self.features_processor(self.feature_key(row)))
            out = {"features": sample.pop("features"), "feature_mask": sample.pop("mask")}
            if sample.get("boxes") is not None:
                out["boxes"] = sample.pop("boxes")
            return out
        path = self.image_path(row)
        try:
            image = decode_image(path)
        except (OSError, ValueError) as e:
            if self.policy == "error":
                raise UserError(f"{self.dataset}: image {str(path)!r} cannot be decoded ({str(e).replace(repr(str(path)), 'it').replace(str(path), 'it')}); replace the file or "
                                "set on_bad_image: skip.") from None
            self.skipped += 1
            log.warning("%s: skipped undecodable image %s (%s); %d skipped so far in this process",
                        self.dataset, path, e, self.skipped)
            return None
        return {"image": (self.image_processor or _PLAIN_PIXELS)(image)}

    def make_item(self, row: int) -> dict[str, Any] | None:  # pragma: no cover - abstract
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        n = len(self.records)
        for step in range(n):
            item = self.make_item((index + step) % n)
            if item is not None:
                return item
        raise UserError(f"{self.dataset}: no image of this split can be decoded; check the image files.")


# -- the builders' shared plumbing -------------------------------------------------------------
class FileDatasetBuilder(DatasetBuilder):
    """Splits described under ``splits.<split>``, processors under ``processors``, built datasets kept.

    Subclasses set ``name`` and implement ``source_files(split)`` (the files a split is
    parsed from, which key its cache entry), ``load_records(split)`` (parse them into a
    :class:`~mmvl.data.records.Table`, or a dict of tables with the samples under
    ``"records"``), ``train_texts()`` and ``make_dataset(split, records)``.
    """

    name = "dataset"

    def __init__(self, config: DictConfig, data_dir: str):
        super().__init__(config if config is not None else OmegaConf.create({}), data_dir)
        self.cfg: dict[str, Any] = plain(self.config) or {}
        self.policy = check_policy(self.cfg.get("on_bad_image", "error"), self.name)
        self._tables: dict[str, dict[str, Table]] = {}
        self._records: dict[str, Table] = {}
        self._datasets: dict[str, Dataset] = {}
        self._processors: dict[str, Any] = {}

    def path(self, relative: str | os.PathLike) -> Path:
        return data_path(self.data_dir, self.cfg.get("data_folder"), relative)

    def split_config(self, split: str) -> dict[str, Any]:
        splits = self.cfg.get("splits") or {}
        spec = splits.get(split)
        if not spec:
            configured = [s for s, v in splits.items() if v]
            raise UserError(f"{self.name}: split {split!r} is not configured (configured: {configured}); set "
                            f"dataset_config.{self.name}.splits.{split} or choose another run_type.")
        return dict(spec)

    def split_file(self, split: str, key: str, what: str) -> Path:
        """The file ``splits.<split>.<key>`` names (under the data folder); a UserError when unset."""
        name = self.split_config(split).get(key)
        if not name:
            raise UserError(f"{self.name}: splits.{split}.{key} is not set; give {what}.")
        return self.path(name)

    def source_files(self, split: str) -> list[Path]:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def cache(self) -> Cache:
        return Cache(default_root(self.cache_dir, self.data_dir), self.name)

    def records_key(self, split: str) -> str:
        """The cache key of ``split``'s parsed records: its source files' fingerprint."""
        return make_key(self.name, split, fingerprint(self.source_files(split)))

    def tables(self, split: str) -> dict[str, Table]:
        """The split's parsed tables, memory-mapped from the cache (parsed and cached on first use)."""
        if split not in self._tables:
            def build(folder: Path) -> None:
                parsed = self.load_records(split)
                save_tables(folder, parsed if isinstance(parsed, dict) else {"records": parsed})

            paths = make_key([str(p) for p in self.source_files(split)])[:8]  # stale = same files, changed
            self._tables[split] = self.cache.get(f"{split}.{paths}", self.records_key(split), build, load_tables,
                                                 f"{split} split")
        return self._tables[split]

    def records(self, split: str) -> Table:
        """The split's samples as a columnar table (capped at ``max_samples``)."""
        if split not in self._records:
            records = self.tables(split)["records"]
            cap = self.cfg.get("max_samples")
            self._records[split] = records.head(int(cap)) if cap else records
        return self._records[split]

    def prepare_split(self, split: str) -> None:
        """Parse (or map) ``split`` and build the processors it needs, caching what can be cached."""
        self.records(split)
        self.text_processor  # noqa: B018  (fits and caches the vocabulary on first use)

    def processor(self, key: str, **extra: Any) -> Any:
        """The processor configured under ``processors.<key>`` (None when unset or null).

        ``extra`` params fit a processor on the training split (e.g. ``texts``); a fitted
        processor that can ``save()`` itself and load a ``vocab_file`` is cached: later
        runs build it from the cached file instead of the training split.
        """
        if key not in self._processors:
            spec = (self.cfg.get("processors") or {}).get(key)
            if not spec:
                self._processors[key] = None
            elif extra and self._cacheable(spec):
                self._processors[key] = self._fitted(key, spec, extra)
            else:
                self._processors[key] = build_processor(spec, self.name, key, **extra)
        return self._processors[key]

    def _cacheable(self, spec: Any) -> bool:
        kind, params = component_spec(spec, "processor")
        if params.get("vocab_file"):
            return False
        cls = PROCESSORS.get(kind)
        takes_fit = any(accepts(cls, name) for name in ("texts", "answers", "answer_counts"))
        return takes_fit and accepts(cls, "vocab_file") and callable(getattr(cls, "save", None))

    def _fitted(self, key: str, spec: Any, extra: dict[str, Any]) -> Any:
        file = f"{key}.txt"
        settings = {k: v for k, v in extra.items() if not callable(v)}  # e.g. mask_probability
        cache_key = make_key(self.name, key, plain(spec), sorted(extra), settings, self.records_key("train"),
                             self.cfg.get("max_samples"))

        def build(folder: Path) -> None:
            build_processor(spec, self.name, key, **extra).save(folder / file)

        def load(folder: Path) -> Any:
            return build_processor(spec, self.name, key, vocab_file=str(folder / file), **settings)

        return self.cache.get(key, cache_key, build, load, f"{key} vocabulary", prune=False)

    def has_vocab_file(self, key: str) -> bool:
        spec = (self.cfg.get("processors") or {}).get(key) or {}
        return bool((spec.get("params") or {}).get("vocab_file"))

    def text_extras(self) -> dict[str, Any]:
        """Params offered to the text processor (dropped when it does not take them)."""
        return {} if self.has_vocab_file("text_processor") else {"texts": self.train_texts}

    @property
    def text_processor(self) -> Any:
        proc = self.processor("text_processor", **self.text_extras())
        if proc is None:
            raise UserError(f"{self.name}: processors.text_processor is not set; use e.g. "
                            "{type: vocab} or {type: bert_tokenizer, params: {tokenizer_path: minilm}}.")
        return proc

    @property
    def image_processor(self) -> Any:
        return self.processor("image_processor")

    @property
    def features_processor(self) -> Any:
        spec = (self.cfg.get("processors") or {}).get("features")
        if spec:
            import mmvl.data.features  # noqa: F401  (registers the features processor)
        return self.processor("features", data_dir=self.data_dir)

    def features_info(self) -> dict[str, int]:
        """``feature_dim`` (the width of the served region features), for model configs leaving it null."""
        features = self.features_processor
        ids = features.ids() if features is not None else []
        return {"feature_dim": int(features(ids[0])["features"].shape[-1])} if ids else {}

    def build(self, split: str) -> Dataset:
        if split not in self._datasets:
            self._datasets[split] = self.make_dataset(split, self.records(split))
        return self._datasets[split]

    def readable_rows(self, split: str, records: Table, path_of: Callable[[int], Path]) -> np.ndarray | None:
        """Apply ``on_bad_image`` up front: the rows to keep, or None for all (feature runs never open images)."""
        if self.features_processor is not None:
            return None
        return readable_rows(records, path_of, self.name, split, self.policy)
