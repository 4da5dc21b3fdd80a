"""The ``features`` processor: image id -> padded region/grid feature tensors.

Config: ``processors.features: {type: features, params: {path, max_features, allow_pickle}}``;
``path`` is an mmvl/MMF LMDB or a folder of ``<id>.npy`` files.
"""
from __future__ import annotations

import os
from typing import Any

from mmvl.data.features.lmdb_store import LMDBFeatureReader
from mmvl.data.features.npy import NpyFeatureReader
from mmvl.errors import UserError
from mmvl.registry import register_processor


def is_lmdb(path: str) -> bool:
    """An LMDB file, or a folder holding ``data.mdb`` (a ``.lmdb`` name counts when it does not exist yet)."""
    if os.path.isdir(path):
        return os.path.isfile(os.path.join(path, "data.mdb"))
    return os.path.isfile(path) or path.endswith((".lmdb", ".mdb"))


def open_features(path: str | os.PathLike, max_features: int | None = None, allow_pickle: bool = False,
                  data_dir: str | None = None) -> LMDBFeatureReader | NpyFeatureReader:
    """The reader for ``path`` (relative paths resolve against ``data_dir`` when given)."""
    resolved = os.path.expanduser(str(path))
    if data_dir and not os.path.isabs(resolved):
        resolved = os.path.join(os.path.expanduser(str(data_dir)), resolved)
    if not os.path.exists(resolved):
        raise UserError(f"features path {os.path.abspath(resolved)} does not exist; give a feature LMDB or a "
                        "folder of <id>.npy files (processors.features.params.path in a config).")
    if is_lmdb(resolved):
        return LMDBFeatureReader(resolved, max_features, allow_pickle)
    return NpyFeatureReader(resolved, max_features, allow_pickle)


@register_processor("features")
class FeaturesProcessor:
    """``processor(image_id)`` -> ``features``, ``boxes``, ``mask``, ``num_boxes``, ``image_width``, ``image_height``.

    ``prefix`` renames the keys (e.g. ``prefix: image_`` gives ``image_features``) for
    datasets with more than one feature source.
    """

    def __init__(self, path: str, max_features: int | None = 100, allow_pickle: bool = False,
                 prefix: str = "", data_dir: str | None = None):
        self.reader = open_features(path, max_features, allow_pickle, data_dir)
        self.prefix = str(prefix or "")

    def __call__(self, image_id: Any) -> dict[str, Any]:
        sample = self.reader[image_id]
        if self.prefix:
            return {self.prefix + k: v for k, v in sample.items()}
        return sample

    def ids(self) -> list[str]:
        return self.reader.ids()

    def __len__(self) -> int:
        return len(self.reader)
