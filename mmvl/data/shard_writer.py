"""Write WebDataset shards of image-text pairs from an image folder and a captions file.

The captions file lists one pair a line: JSON Lines ``{"image": "<path under the folder>",
"caption": "..."}`` or a TSV ``<path>\\t<caption>``. Each sample becomes ``{key}.<ext>`` (the image
bytes as they are, jpg/jpeg/png/webp) and ``{key}.txt`` in ``<prefix>-000000.tar``,
``<prefix>-000001.tar``... with ``samples_per_shard`` samples each (what img2dataset writes, so
``mmvl`` reads either). Each shard is written through :func:`mmvl.io.atomic_open`: a shard on
disk is always complete.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from mmvl.data.shards import IMAGE_EXTS, require_webdataset
from mmvl.errors import UserError
from mmvl.io import atomic_open


def read_pairs(captions: Path) -> Iterator[tuple[int, str, str]]:
    """``(line number, image path, caption)`` of a ``.jsonl`` or ``.tsv`` captions file."""
    if not captions.is_file():
        raise UserError(f"mmvl_shards: captions file {str(captions)!r} does not exist.")
    as_json = captions.suffix.lower() in (".jsonl", ".json")
    with open(captions, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                if as_json:
                    record = json.loads(line)
                    image, caption = record["image"], record["caption"]
                else:
                    image, caption = line.rstrip("\n").split("\t", 1)
            except (ValueError, KeyError, TypeError):
                form = '{"image": ..., "caption": ...}' if as_json else "<image path>\\t<caption>"
                raise UserError(f"mmvl_shards: {str(captions)!r} line {lineno} is not {form}.") from None
            yield lineno, str(image), str(caption)


def write_shards(images: str | Path, captions: str | Path, out: str | Path, *, prefix: str = "train",
                 samples_per_shard: int = 10000) -> list[Path]:
    """Write the pairs of ``captions`` (images under ``images``) as shards in ``out``; returns their paths."""
    require_webdataset()
    from webdataset import TarWriter

    images, captions, out = Path(images), Path(captions), Path(out)
    if samples_per_shard < 1:
        raise UserError(f"mmvl_shards: --samples-per-shard={samples_per_shard} must be at least 1.")
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    pairs = read_pairs(captions)
    pending = next(pairs, None)
    if pending is None:
        raise UserError(f"mmvl_shards: {str(captions)!r} lists no image-caption pair.")
    index = 0
    while pending is not None:
        path = out / f"{prefix}-{len(written):06d}.tar"
        with atomic_open(path, "wb") as f:
            writer = TarWriter(f)
            for _ in range(samples_per_shard):
                if pending is None:
                    break
                lineno, name, caption = pending
                image = images / name
                ext = image.suffix.lower().lstrip(".")
                if ext not in IMAGE_EXTS or not image.is_file():
                    raise UserError(f"mmvl_shards: {str(captions)!r} line {lineno} names {str(image)!r}, which is "
                                    f"not an existing {'/'.join(IMAGE_EXTS)} file.")
                writer.write({"__key__": f"{index:09d}", ext: image.read_bytes(), "txt": caption})
                index += 1
                pending = next(pairs, None)
            writer.close()  # flushes the tar's end blocks into f (the stream stays open: atomic_open owns it)
        written.append(path)
    return written
