"""The pickle-free value format: round trips, zero-copy decoding, and rejection of damaged bytes."""
from __future__ import annotations

import numpy as np
import pytest

from mmvl.data.features import format as fmt


def _value(rows=7, dim=5, fp16=False, boxes=True):
    rng = np.random.default_rng(0)
    feats = rng.standard_normal((rows, dim)).astype(np.float32)
    bbox = rng.uniform(0, 50, (rows, 4)) if boxes else None
    return feats, bbox, fmt.encode(feats, bbox, 100, 50, rows - 1, fp16=fp16)


@pytest.mark.parametrize("fp16", [False, True])
def test_round_trip_keeps_arrays_and_header(fp16):
    feats, bbox, value = _value(fp16=fp16)
    rec = fmt.decode(value)
    assert rec.features.dtype == (np.float16 if fp16 else np.float32)
    np.testing.assert_array_equal(rec.features, feats.astype(rec.features.dtype))
    np.testing.assert_allclose(rec.boxes, np.clip(bbox / [100, 50, 100, 50], 0, 1), rtol=1e-6)
    assert rec.boxes_normalised and (rec.image_width, rec.image_height, rec.num_boxes) == (100, 50, 6)


def test_decode_is_zero_copy_and_aligned():
    _, _, value = _value(rows=3, dim=3, fp16=True)  # 18 feature bytes: boxes need padding to stay aligned
    buf = memoryview(value)
    rec = fmt.decode(buf)
    assert np.shares_memory(rec.features, np.frombuffer(value, np.uint8))
    assert rec.features.ctypes.data % 2 == 0 and rec.boxes.ctypes.data % 4 == 0
    assert rec.boxes.shape == (3, 4) and rec.features.shape == (3, 3)


def test_features_without_boxes():
    rec = fmt.decode(fmt.encode(np.ones((2, 3), np.float32)))
    assert rec.boxes is None and rec.num_boxes == 2 and (rec.image_width, rec.image_height) == (0, 0)


def test_pixel_boxes_without_image_size_stay_pixels():
    rec = fmt.decode(fmt.encode(np.ones((1, 2), np.float32), np.array([[1.0, 2.0, 30.0, 40.0]])))
    assert not rec.boxes_normalised and rec.boxes[0, 2] == 30.0


@pytest.mark.parametrize("damage, needle", [
    (lambda v: v[:-1], "bytes"),                     # truncated array
    (lambda v: v[:10], "header"),                     # truncated header
    (lambda v: v + b"\0" * 8, "bytes"),               # trailing garbage
    (lambda v: b"XXXX" + v[4:], "magic"),
    (lambda v: v[:4] + bytes([9]) + v[5:], "version"),
    (lambda v: v[:5] + bytes([77]) + v[6:], "dtype"),
])
def test_damaged_values_raise(damage, needle):
    _, _, value = _value()
    with pytest.raises(fmt.FeatureFormatError, match=needle):
        fmt.decode(damage(value))


def test_rejects_non_2d_features():
    with pytest.raises(ValueError, match="2-D"):
        fmt.encode(np.zeros((2, 3, 4), np.float32))
