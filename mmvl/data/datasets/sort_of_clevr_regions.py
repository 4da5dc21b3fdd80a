"""Sort-of-CLEVR's objects as regions (``dataset_config.sort_of_clevr.regions: crops``).

VL models on VQA read detector regions (a feature and a box per object), not pixels. Here
the detector is an oracle: the generator knows every object's centre, so each region is cut
exactly around one object. That isolates reasoning over given objects (the RN paper's
state-description setting) from finding them.
"""
from __future__ import annotations

import numpy as np


def object_regions(images: np.ndarray, centers: np.ndarray, obj: int, background: int,
                   seed: int) -> dict[str, np.ndarray]:
    """Each object as a region cut at the generator's own boxes: an oracle detector.

    ``features`` N x 6 x (2*obj+3)^2*3 uint8 (the pixels of a square around each centre, one
    pixel wider than the object, so the crop shows its corners or their absence but never a
    neighbour), ``boxes`` N x 6 x 4 float32 (the object's x1, y1, x2, y2 in [0, 1]). The six
    regions come in a random order per image (seeded), not in colour order, which would tell a
    model which object is which without looking at it.
    """
    n, size = images.shape[0], images.shape[1]
    half = obj + 1
    padded = np.pad(images, ((0, 0), (half, half), (half, half), (0, 0)), constant_values=background)
    order = np.argsort(np.random.default_rng(seed).random((n, centers.shape[1])), axis=1)
    xy = np.take_along_axis(centers, order[..., None], axis=1)  # N x 6 x 2, shuffled
    side = 2 * half + 1
    offsets = np.arange(side)
    rows = (xy[..., 1, None] + offsets)[:, :, :, None]  # padded coordinates: centre - half + half
    cols = (xy[..., 0, None] + offsets)[:, :, None, :]
    crops = padded[np.arange(n)[:, None, None, None], rows, cols]  # N x 6 x side x side x 3
    boxes = np.concatenate([xy - obj, xy + obj + 1], axis=-1).astype(np.float32) / size
    return {"features": crops.reshape(n, centers.shape[1], -1), "boxes": boxes}
