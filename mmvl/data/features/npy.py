"""MMF's ``.npy`` feature layout: ``<id>.npy`` arrays with optional ``<id>_info.npy`` side files.

MMF's ``_info.npy`` files hold a pickled dict (``bbox``, ``image_width``,
``image_height``, ``num_boxes``, ``objects``, ``cls_prob``); unpickling runs
code from the file, so it needs ``allow_pickle`` and a trusted source.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from mmvl.data.features.assemble import check_max_features, key_of, to_sample
from mmvl.data.features.format import FeatureFormatError
from mmvl.errors import UserError

INFO_SUFFIX = "_info.npy"


def list_ids(root: str) -> list[str]:
    """Ids of every ``<id>.npy`` under ``root`` (recursive, ``/``-separated, sorted), side files excluded."""
    ids = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            if name.endswith(".npy") and not name.endswith(INFO_SUFFIX):
                rel = os.path.relpath(os.path.join(dirpath, name), root)[:-4]
                ids.append(rel.replace(os.sep, "/"))
    return sorted(ids)


def _load(path: str, allow_pickle: bool) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=allow_pickle)
    except ValueError as e:
        if "allow_pickle" in str(e):
            raise UserError(
                f"{path} holds pickled Python objects (MMF's _info dicts do); pass --allow-pickle "
                "(allow_pickle: true in a config) only if the source is trusted, since unpickling runs code."
            ) from None
        raise UserError(f"{path} is not a readable .npy file ({e}); re-create it.") from None
    except (OSError, EOFError) as e:
        raise UserError(f"{path} is not a readable .npy file ({e}); re-create it.") from None


def load_item(root: str, key: str, allow_pickle: bool) -> tuple[np.ndarray, dict[str, Any]]:
    """``(features N x C, info dict)`` for one id; the info dict is empty without a side file."""
    path = os.path.join(root, key + ".npy")
    features = _load(path, allow_pickle)
    info: dict[str, Any] = {}
    if features.dtype == object and features.shape == () and isinstance(features.item(), dict):
        info = dict(features.item())  # some extractors save one dict per image
        features = np.asarray(info.pop("features", info.pop("image_feat", None)))
    info_path = os.path.join(root, key + INFO_SUFFIX)
    if os.path.exists(info_path):
        raw = _load(info_path, allow_pickle)
        if not (raw.dtype == object and raw.shape == () and isinstance(raw.item(), dict)):
            raise UserError(f"{info_path} should hold a dict (bbox, image_width, ...), got a {raw.dtype} "
                            f"array of shape {raw.shape}; re-create the side file.")
        info.update(raw.item())
    if features.ndim == 3 and features.shape[0] == 1:
        features = features[0]
    if features.ndim != 2 or not np.issubdtype(features.dtype, np.floating):
        raise UserError(f"{path}: features must be a 2-D float array (num_boxes x dim), got "
                        f"{features.dtype} {features.shape}; re-extract or reshape them.")
    return features, info


class NpyFeatureReader:
    """``reader[id]`` over a folder of ``<id>.npy`` files; same output as the LMDB reader."""

    def __init__(self, root: str | os.PathLike, max_features: int | None = None, allow_pickle: bool = False):
        self.root = os.path.abspath(os.path.expanduser(str(root)))
        if not os.path.isdir(self.root):
            raise UserError(f"feature folder {self.root} does not exist; fix the features path.")
        self.max_features = check_max_features(max_features)
        self.allow_pickle = bool(allow_pickle)
        self._ids: list[str] | None = None

    def __getitem__(self, sample_id: Any) -> dict[str, Any]:
        key = key_of(sample_id)
        if ".." in key.replace(os.sep, "/").split("/") or os.path.isabs(key):
            raise UserError(f"feature id {key!r} points outside {self.root}; ids are paths relative to it.")
        if not os.path.isfile(os.path.join(self.root, key + ".npy")):
            raise UserError(f"no features for id {key!r} in {self.root} (no {key}.npy); check that the "
                            "dataset's image ids match the feature file names.")
        features, info = load_item(self.root, key, self.allow_pickle)
        boxes = info.get("bbox")
        try:
            return to_sample(features, None if boxes is None else np.asarray(boxes),
                             int(info.get("image_width") or 0), int(info.get("image_height") or 0),
                             info.get("num_boxes"), False, self.max_features)
        except FeatureFormatError as e:
            raise UserError(f"features for id {key!r} in {self.root} are unusable ({e}); fix the _info file.") from None

    def ids(self) -> list[str]:
        if self._ids is None:
            self._ids = list_ids(self.root)
        return self._ids

    def __contains__(self, sample_id: Any) -> bool:
        return os.path.isfile(os.path.join(self.root, key_of(sample_id) + ".npy"))

    def __len__(self) -> int:
        return len(self.ids())

    def __repr__(self) -> str:
        return f"NpyFeatureReader({self.root!r}, max_features={self.max_features})"
