"""Convert MMF feature sources (a ``.npy`` folder, a pickled LMDB) into an mmvl feature LMDB."""
from __future__ import annotations

import os
import pickle
import re
from typing import Any, Iterable, Iterator

import numpy as np

from mmvl.data.features import format as fmt
from mmvl.data.features.lmdb_store import META_KEY, MMF_KEYS, LMDBFeatureWriter, open_env
from mmvl.data.features.npy import list_ids, load_item
from mmvl.errors import UserError

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str | int) -> int:
    """``"64G"``, ``"512M"`` or a byte count -> bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)i?B?\s*", str(text), flags=re.IGNORECASE)
    if not match or int(match.group(1)) == 0:
        raise UserError(f"--map-size {text!r} is not a size; use bytes or a number with K/M/G/T, e.g. 64G.")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def put_item(writer: LMDBFeatureWriter, key: str, features: Any, info: dict[str, Any], fp16: bool,
             where: str) -> None:
    """Write one MMF-style item (features + info dict with bbox/image_width/...); ``where`` names the source."""
    features = np.asarray(features)
    if features.ndim == 3 and features.shape[0] == 1:
        features = features[0]
    if features.ndim != 2 or not np.issubdtype(features.dtype, np.floating):
        raise UserError(f"{where}: features must be a 2-D float array (num_boxes x dim), got {features.dtype} "
                        f"{features.shape}; re-extract them.")
    boxes = info.get("bbox")
    boxes = None if boxes is None else np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    width, height = int(info.get("image_width") or 0), int(info.get("image_height") or 0)
    normalised = False
    if boxes is not None and boxes.size and (width <= 0 or height <= 0):
        if float(boxes.max()) > 1.0 + 1e-6:
            raise UserError(f"{where}: boxes are in pixels but image_width/image_height are missing, so they "
                            "cannot be normalised; add them to the _info file.")
        normalised = True
    num_boxes = info.get("num_boxes")
    writer.put(key, features, boxes, max(width, 0), max(height, 0),
               None if num_boxes is None else int(num_boxes), fp16=fp16, boxes_normalised=normalised)


def _progress(items: Iterable[Any], total: int, show: bool, desc: str) -> Iterable[Any]:
    if not show:
        return items
    from tqdm import tqdm

    return tqdm(items, total=total, desc=desc, unit="img")


def convert_npy_dir(npy_dir: str, out: str, fp16: bool = False, allow_pickle: bool = False,
                    map_size: int | None = None, overwrite: bool = False, progress: bool = False) -> tuple[str, int]:
    """``<id>.npy`` (+ ``<id>_info.npy``) under ``npy_dir`` -> ``out``; returns ``(path, count)``."""
    root = os.path.abspath(os.path.expanduser(str(npy_dir)))
    if not os.path.isdir(root):
        raise UserError(f"--npy-dir {root} does not exist or is not a folder; give the folder of <id>.npy files.")
    ids = list_ids(root)
    if not ids:
        raise UserError(f"--npy-dir {root} holds no <id>.npy feature files.")
    if map_size is None:
        total = sum(os.path.getsize(os.path.join(root, k + ".npy")) for k in ids)
        map_size = int(total * 1.2) + (64 << 20)
    with LMDBFeatureWriter(out, map_size, overwrite) as writer:
        for key in _progress(ids, len(ids), progress, "convert"):
            features, info = load_item(root, key, allow_pickle)
            put_item(writer, key, features, info, fp16, os.path.join(root, key + ".npy"))
    return writer.path, len(ids)


def _mmf_items(src: str) -> Iterator[tuple[str, Any]]:
    env = open_env(src)
    with env.begin() as txn:
        for key, value in txn.cursor():
            if key not in (MMF_KEYS, META_KEY):
                yield key.decode("utf-8", "replace"), value


def convert_mmf_lmdb(src: str, out: str, fp16: bool = False, allow_pickle: bool = False,
                     map_size: int | None = None, overwrite: bool = False, progress: bool = False) -> tuple[str, int]:
    """An MMF LMDB (one pickled dict per value) -> ``out``; needs ``allow_pickle`` (trusted sources only)."""
    src = os.path.abspath(os.path.expanduser(str(src)))
    if not os.path.exists(src):
        raise UserError(f"--mmf-lmdb {src} does not exist; give the MMF feature LMDB to convert.")
    if not allow_pickle:
        raise UserError(f"--mmf-lmdb {src} stores pickled values; pass --allow-pickle only if the source is "
                        "trusted, since unpickling runs code.")
    count = 0
    with LMDBFeatureWriter(out, map_size or int(_disk_size(src) * 1.2) + (64 << 20), overwrite) as writer:
        items = _mmf_items(src)
        for key, value in _progress(items, 0, progress, "convert"):
            where = f"id {key!r} in {src}"
            if fmt.is_record(value):
                rec = fmt.decode(value)
                writer.put(key, rec.features, rec.boxes, rec.image_width, rec.image_height, rec.num_boxes,
                           fp16, rec.boxes_normalised)
            else:
                try:
                    item = pickle.loads(value)
                    features = item["features"]
                except Exception as e:  # a damaged pickle can raise nearly anything
                    raise UserError(f"{where} is not a pickled MMF feature dict ({type(e).__name__}: {e}).") from None
                put_item(writer, key, features, item, fp16, where)
            count += 1
        if count == 0:
            raise UserError(f"--mmf-lmdb {src} holds no feature values.")
    return writer.path, count


def _disk_size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
