"""Turn one stored record (numpy arrays) into the fixed-size tensors a model reads.

Shared by every reader so the LMDB, pickled-LMDB and ``.npy`` sources yield
identical samples. Features keep their stored dtype (fp16 stays fp16 on the
host; the model casts on device) and are copied at most once, straight into
the padded output; arrays the reader may hand out as they are (private, or
copy-on-write views) are not copied at all.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mmvl.data.features.format import FeatureFormatError


def key_of(sample_id: Any) -> str:
    """The store key for a dataset's image id: ``str(id)`` without a trailing ``.npy`` (MMF's feature_path)."""
    key = str(sample_id)
    return key[:-4] if key.endswith(".npy") else key


def check_max_features(max_features: Any) -> int | None:
    """Validate the ``max_features`` option (``None`` keeps every stored row)."""
    if max_features is None:
        return None
    if isinstance(max_features, bool) or not isinstance(max_features, int) or max_features < 1:
        from mmvl.errors import UserError

        raise UserError(f"features: max_features={max_features!r} must be a positive integer or null.")
    return max_features


def to_sample(features: np.ndarray, boxes: np.ndarray | None, image_width: int, image_height: int,
              num_boxes: int | None, boxes_normalised: bool, max_features: int | None) -> dict[str, Any]:
    """Pad or truncate to ``max_features`` rows; boxes become ``[0, 1]`` fractions of the image size.

    Returns ``features [M, C]`` (fp16 or fp32), ``boxes [M, 4]`` fp32, ``mask [M]`` long (1 real,
    0 pad), ``num_boxes`` (real rows kept), ``image_width``, ``image_height``. Runs once per
    sample in every DataLoader worker, so it sticks to a few numpy calls on small arrays.
    """
    rows, dim = features.shape
    m = rows if max_features is None else max_features
    n = rows if rows < m else m
    real = n if num_boxes is None or num_boxes > n else int(num_boxes)
    dtype = _F16 if features.dtype == _F16 else _F32
    if rows >= m and features.dtype == dtype and features.flags.writeable and features.flags.c_contiguous:
        out = features[:m]  # private (np.load, pickle) or copy-on-write (the LMDB reader's map): no copy
    elif rows == m:
        out = np.array(features, dtype=dtype)  # the one copy, out of the memory map
    else:
        out = np.empty((m, dim), dtype=dtype)
        out[:n] = features[:n]
        if n < m:
            out[n:] = 0
    mask = np.zeros(m, dtype=np.int64)
    mask[:real] = 1
    if boxes_normalised and boxes is not None and boxes.shape == (m, 4):
        box_out = np.array(boxes, dtype=np.float32)  # stored normalised and clipped by the writer
    else:
        box_out = _boxes(boxes, image_width, image_height, boxes_normalised, m)
    return {
        "features": torch.from_numpy(out),
        "boxes": torch.from_numpy(box_out),
        "mask": torch.from_numpy(mask),
        "num_boxes": real,
        "image_width": int(image_width),
        "image_height": int(image_height),
    }


def _boxes(boxes: np.ndarray | None, image_width: int, image_height: int, normalised: bool, m: int) -> np.ndarray:
    """``m x 4`` fractions of the image size, zero-padded (the general, slower path)."""
    box_out = np.zeros((m, 4), dtype=np.float32)
    if boxes is not None and len(boxes):
        nb = min(len(boxes), m)
        dst = box_out[:nb]
        if normalised:
            dst[:] = boxes[:nb, :4]
        elif image_width > 0 and image_height > 0:
            np.divide(boxes[:nb, :4], np.array((image_width, image_height, image_width, image_height),
                                               dtype=np.float32), out=dst, casting="unsafe")
        else:
            dst[:] = boxes[:nb, :4]
            if dst.size and float(dst.max()) > 1.0 + 1e-6:
                raise FeatureFormatError("boxes are in pixels but the image width/height are missing")
        np.minimum(dst, 1.0, out=dst)
        np.maximum(dst, 0.0, out=dst)
    return box_out


_F16 = np.dtype(np.float16)
_F32 = np.dtype(np.float32)
