"""The byte layout of one stored feature value (no pickle).

A value is a fixed 40-byte little-endian header followed by the raw feature
array and then the raw boxes array, each starting on an 8-byte boundary::

    magic b"MMVF" | version u8 | feature dtype u8 | boxes dtype u8 | flags u8 |
    rows u32 | dim u32 | box rows u32 | box cols u32 |
    image width u32 | image height u32 | num boxes u32 | reserved u32
    <features rows x dim> <pad to 8> <boxes box_rows x box_cols>

A fixed struct (not JSON) keeps decoding to one ``unpack_from`` per sample, and
raw arrays let :func:`decode` hand back zero-copy ``np.frombuffer`` views.
"""
from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

MAGIC = b"MMVF"
VERSION = 1
HEADER = struct.Struct("<4sBBBB8I")
HEADER_SIZE = HEADER.size  # 40

#: dtype codes; 0 means "no array" (boxes only)
DTYPES: dict[int, np.dtype] = {1: np.dtype("<f2"), 2: np.dtype("<f4")}
CODES: dict[np.dtype, int] = {v: k for k, v in DTYPES.items()}

#: flag bits
FLAG_BOXES_NORMALISED = 1


class FeatureFormatError(ValueError):
    """A value that is not a well-formed mmvl feature record (the reader names the id and path)."""


class FeatureRecord(NamedTuple):
    """One decoded value; ``features`` and ``boxes`` may be read-only views into the source buffer."""

    features: np.ndarray
    boxes: np.ndarray | None
    image_width: int
    image_height: int
    num_boxes: int
    boxes_normalised: bool


def _align8(n: int) -> int:
    return (n + 7) & ~7


def is_record(buf: bytes | memoryview) -> bool:
    """True when ``buf`` starts with the mmvl magic (anything else may be a legacy pickle)."""
    return buf[:4] == MAGIC


def encode(features: np.ndarray, boxes: np.ndarray | None = None, image_width: int = 0,
           image_height: int = 0, num_boxes: int | None = None, fp16: bool = False,
           boxes_normalised: bool = False) -> bytes:
    """Serialise one sample; ``features`` is ``N x C`` (stored as fp16 when ``fp16``, else fp16/fp32 as given).

    Boxes (``N' x 4``, pixel coordinates unless ``boxes_normalised``) are stored as fp32
    fractions of the image size (clipped to ``[0, 1]``) whenever the size is known, so
    readers only copy them; the size stays in the header to recover pixels.
    """
    features = np.asarray(features)
    if features.ndim != 2:
        raise ValueError(f"features must be 2-D (num_boxes x dim), got shape {features.shape}")
    if not np.issubdtype(features.dtype, np.floating):
        raise ValueError(f"features must be floating point, got {features.dtype}")
    fdtype = np.dtype("<f2") if fp16 or features.dtype == np.float16 else np.dtype("<f4")
    features = np.ascontiguousarray(features, dtype=fdtype)
    rows, dim = features.shape
    box_code, box_rows, box_cols, box_bytes = 0, 0, 0, b""
    if boxes is not None:
        boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
        if not boxes_normalised and int(image_width) > 0 and int(image_height) > 0:
            boxes = np.clip(boxes / np.array([image_width, image_height, image_width, image_height]), 0.0, 1.0)
            boxes_normalised = True
        boxes = np.ascontiguousarray(boxes, dtype="<f4")
        box_code, (box_rows, box_cols) = CODES[boxes.dtype], boxes.shape
        box_bytes = boxes.tobytes()
    n_real = rows if num_boxes is None else int(num_boxes)
    if min(n_real, int(image_width), int(image_height)) < 0:
        raise ValueError(f"negative num_boxes/image size ({n_real}, {image_width}, {image_height})")
    flags = FLAG_BOXES_NORMALISED if boxes_normalised else 0
    header = HEADER.pack(MAGIC, VERSION, CODES[fdtype], box_code, flags, rows, dim, box_rows, box_cols,
                         int(image_width), int(image_height), n_real, 0)
    feat_bytes = features.tobytes()
    pad = b"\0" * (_align8(HEADER_SIZE + len(feat_bytes)) - HEADER_SIZE - len(feat_bytes))
    return b"".join((header, feat_bytes, pad, box_bytes))


def decode(buf: bytes | memoryview) -> FeatureRecord:
    """Parse one value without copying its arrays; raise :class:`FeatureFormatError` if malformed."""
    if len(buf) < HEADER_SIZE:
        raise FeatureFormatError(f"{len(buf)} bytes, shorter than the {HEADER_SIZE}-byte header")
    (magic, version, fcode, bcode, flags, rows, dim, brows, bcols,
     width, height, num_boxes, _) = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise FeatureFormatError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise FeatureFormatError(f"format version {version}, this mmvl reads version {VERSION}")
    fdtype = DTYPES.get(fcode)
    if fdtype is None or (bcode and bcode not in DTYPES):
        raise FeatureFormatError(f"unknown dtype codes {fcode}/{bcode}")
    feat_bytes = rows * dim * fdtype.itemsize
    box_off = _align8(HEADER_SIZE + feat_bytes)
    box_bytes = brows * bcols * DTYPES[bcode].itemsize if bcode else 0
    expected = box_off + box_bytes
    if len(buf) != expected:
        raise FeatureFormatError(f"{len(buf)} bytes, the header promises {expected}")
    features = np.ndarray((rows, dim), fdtype, buf, HEADER_SIZE)  # a view: no copy
    boxes = np.ndarray((brows, bcols), DTYPES[bcode], buf, box_off) if bcode else None
    return FeatureRecord(features, boxes, width, height, num_boxes, bool(flags & FLAG_BOXES_NORMALISED))
