"""Grid features from a torchvision ResNet over an image folder, written to an mmvl feature LMDB.

Each image is resized to ``image_size`` squared; the last conv stage's ``h x w``
grid becomes ``h*w`` rows of ``C`` features, each with its cell's box in the
original image's pixels (the reader normalises by the stored image size).
"""
from __future__ import annotations

import os
from typing import Iterator

import numpy as np
import torch
from torch import nn

from mmvl.data.features.lmdb_store import LMDBFeatureWriter
from mmvl.errors import UserError, did_you_mean

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")
BACKBONES = {"resnet18": 512, "resnet50": 2048}
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


def build_backbone(name: str, weights: str | None = None) -> nn.Module:
    """A ResNet trunk without pooling/fc, random init or a local state dict (``weights_only`` load)."""
    import torchvision

    if name not in BACKBONES:
        raise UserError(f"--backbone {name!r} is not supported.{did_you_mean(name, BACKBONES)} "
                        f"Use one of {', '.join(BACKBONES)}.")
    model = getattr(torchvision.models, name)(weights=None)
    if weights:
        path = os.path.expanduser(weights)
        if not os.path.isfile(path):
            raise UserError(f"--weights {path} does not exist; give a local torchvision {name} state-dict file.")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # not a weights-only checkpoint, or damaged
            raise UserError(f"--weights {path} cannot be loaded as plain tensors ({type(e).__name__}: {e}).") from None
        for wrapper in ("state_dict", "model"):
            if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
                state = state[wrapper]
        if not isinstance(state, dict):
            raise UserError(f"--weights {path} holds a {type(state).__name__}, not a state dict.")
        state = {k.removeprefix("module."): v for k, v in state.items()}
        try:
            result = model.load_state_dict(state, strict=False)
        except RuntimeError as e:  # shape mismatches
            raise UserError(f"--weights {path} does not match {name} ({str(e).splitlines()[-1].strip()}); "
                            f"use a torchvision {name} state dict.") from None
        missing = [k for k in result.missing_keys if not k.startswith("fc.")]
        if missing or any(not k.startswith("fc.") for k in result.unexpected_keys):
            raise UserError(f"--weights {path} does not match {name} (missing e.g. {missing[:3]}, "
                            f"unexpected e.g. {result.unexpected_keys[:3]}); use a torchvision {name} state dict.")
    trunk = nn.Sequential(*list(model.children())[:-2])  # drop avgpool and fc: keep the grid
    return trunk.eval()


def list_images(root: str) -> list[tuple[str, str]]:
    """``(id, path)`` for every image under ``root``; the id is the relative path without extension."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            if name.lower().endswith(IMAGE_EXTS):
                path = os.path.join(dirpath, name)
                found.append((os.path.splitext(os.path.relpath(path, root))[0].replace(os.sep, "/"), path))
    return sorted(found)


def _load_image(path: str, size: int) -> tuple[torch.Tensor, int, int]:
    from PIL import Image

    try:
        with Image.open(path) as img:
            img = img.convert("RGB")
            width, height = img.size
            img = img.resize((size, size), Image.BILINEAR)
            pixels = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy())
    except (OSError, ValueError) as e:
        raise UserError(f"image {path} cannot be read ({e}); remove or replace it.") from None
    return pixels.permute(2, 0, 1), width, height


def _batches(items: list[tuple[str, str]], size: int) -> Iterator[list[tuple[str, str]]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def cell_boxes(grid_h: int, grid_w: int, width: int, height: int) -> np.ndarray:
    """``(grid_h*grid_w) x 4`` pixel boxes ``x1, y1, x2, y2`` of each cell, row-major like the features."""
    xs = np.linspace(0.0, width, grid_w + 1)
    ys = np.linspace(0.0, height, grid_h + 1)
    x1, y1 = np.meshgrid(xs[:-1], ys[:-1])
    x2, y2 = np.meshgrid(xs[1:], ys[1:])
    return np.stack([x1, y1, x2, y2], axis=-1).reshape(-1, 4)


def extract_grid_features(images: str, out: str, backbone: str = "resnet18", weights: str | None = None,
                          image_size: int = 224, batch_size: int = 16, fp16: bool = False,
                          map_size: int | None = None, overwrite: bool = False,
                          progress: bool = False) -> tuple[str, int]:
    """Run ``backbone`` over every image under ``images`` on CPU; returns ``(lmdb path, count)``."""
    if backbone not in BACKBONES:
        build_backbone(backbone)  # raises the UserError naming the choices
    root = os.path.abspath(os.path.expanduser(str(images)))
    if not os.path.isdir(root):
        raise UserError(f"--images {root} does not exist or is not a folder.")
    if image_size < 32:
        raise UserError(f"--image-size {image_size} is too small; ResNets downsample by 32, use at least 32.")
    if batch_size < 1:
        raise UserError(f"--batch-size {batch_size} must be at least 1.")
    items = list_images(root)
    if not items:
        raise UserError(f"--images {root} holds no images ({', '.join(IMAGE_EXTS)}).")
    model = build_backbone(backbone, weights)
    batches = _batches(items, batch_size)
    if progress:
        from tqdm import tqdm

        batches = tqdm(batches, total=(len(items) + batch_size - 1) // batch_size, desc="extract", unit="batch")
    with LMDBFeatureWriter(out, map_size, overwrite) as writer, torch.inference_mode():
        for batch in batches:
            loaded = [_load_image(path, image_size) for _, path in batch]
            pixels = torch.stack([p for p, _, _ in loaded]).float().div_(255.0)
            grid = model((pixels - MEAN) / STD)  # B x C x h x w
            b, c, gh, gw = grid.shape
            rows = grid.permute(0, 2, 3, 1).reshape(b, gh * gw, c).numpy()
            for (key, _), feats, (_, width, height) in zip(batch, rows, loaded):
                writer.put(key, feats, cell_boxes(gh, gw, width, height), width, height, gh * gw, fp16=fp16)
    return writer.path, len(items)
