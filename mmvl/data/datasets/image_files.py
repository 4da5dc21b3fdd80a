"""Image files of file-backed datasets: the bad-image policy, a cheap readability check, the rows whose
image can be read, decoding, and ``verify_images`` (every image decoded before the first update).
Split from ``_common.py`` so the builders' shared code and the image-file checks each read on their own."""
from __future__ import annotations

import logging
from pathlib import Path
from collections.abc import Iterable, Mapping
from typing import Any, Callable

import numpy as np

from mmvl.data.records import Table
from mmvl.errors import UserError

log = logging.getLogger("mmvl")
BAD_IMAGE_POLICIES = ("error", "skip")


def check_policy(value: Any, dataset: str) -> str:
    value = str(value)
    if value not in BAD_IMAGE_POLICIES:
        raise UserError(f"{dataset}: on_bad_image={value!r}; use 'error' or 'skip'.")
    return value


def image_is_readable(path: Path) -> bool:
    """Cheap check (file exists and PIL recognises its header); full decoding happens on use."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            img.size  # noqa: B018  (header only)
        return True
    except (OSError, UnidentifiedImageError, ValueError):
        return False


def readable_rows(records: Table, path_of: Callable[[int], Path], dataset: str, split: str,
                  policy: str) -> np.ndarray | None:
    """With ``skip``: the rows whose image can be read (None when all can), logging how many were dropped.

    With ``error``: only check the first image (a wrong folder fails at once, naming the path);
    every other image is checked when it is decoded.
    """
    if not len(records):
        return None
    if policy == "error":
        first = path_of(0)
        if not first.is_file():
            raise UserError(f"{dataset} {split}: image {str(first)!r} does not exist; check the images folder in "
                            f"dataset_config.{dataset}, or set on_bad_image: skip to drop missing images.")
        return None
    verdict: dict[Path, bool] = {}
    kept, bad = [], []
    for row in range(len(records)):
        p = path_of(row)
        if p not in verdict:
            verdict[p] = image_is_readable(p)
        (kept if verdict[p] else bad).append(row)
    if bad:
        log.warning("%s %s: skipped %d of %d samples whose image is missing or unreadable (e.g. %s)",
                    dataset, split, len(bad), len(records), path_of(bad[0]))
    if not kept:
        raise UserError(f"{dataset} {split}: none of the {len(records)} images can be read (e.g. "
                        f"{str(path_of(0))!r}); check the images folder.")
    return np.asarray(kept, dtype=np.int64) if bad else None


def decode_image(path: Path) -> Any:
    """An RGB PIL image; raises OSError/ValueError when the file cannot be decoded."""
    from PIL import Image

    with Image.open(path) as img:
        img.load()
        return img.convert("RGB")


def image_size(path: Path, where: str) -> tuple[int, int]:
    """``(width, height)`` of an image from its header alone (no pixels decoded); one line naming the
    file when even the header cannot be read."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            return tuple(img.size)  # type: ignore[return-value]
    except (OSError, ValueError) as e:
        raise UserError(f"{where}: image {str(path)!r} cannot be read ({type(e).__name__}); replace the file.") from None


def verify_requested(cfg: Mapping[str, Any], dataset: str) -> bool:
    """``dataset_config.<dataset>.verify_images``: true decodes every image of each split the run uses
    before the first update; false (the default) decodes each when a batch needs it."""
    value = cfg.get("verify_images", False)
    if not isinstance(value, bool):
        raise UserError(f"dataset_config.{dataset}.verify_images={value!r}; use true (decode every image before "
                        "training) or false.")
    return value


def verify_images(samples: Iterable[tuple[str, Callable[[], Any]]], where: str) -> int:
    """Decode every image of ``samples`` (``(what to call it, decode)`` pairs); the ones that fail are
    refused together, in one line naming the first three and how many. Returns how many decoded."""
    bad, total = [], 0
    for label, decode in samples:
        total += 1
        try:
            decode()
        except UserError:
            bad.append(label)
        except (OSError, ValueError) as e:  # PIL's UnidentifiedImageError is an OSError
            bad.append(f"{label} ({type(e).__name__})")
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise UserError(f"{where}: {len(bad)} of {total} images do not decode: {'; '.join(bad[:3])}{more}; replace "
                        "them or drop their samples (verify_images: true decoded every one).")
    return total
