"""Padding-free packing (``training.packing``): a micro-batch's samples share rows instead of each
padding to the longest.

The samples are the sampler's, unchanged (order and resume stay as they are); only where they sit
changes. Rows hold up to ``capacity`` tokens and are balanced (longest sample first, each into the
row with the fewest tokens that still has room), so they end close together and little is padded.
Each sample's positions restart at 0 (``position_ids``), which is how the model knows where one
ends: it attends within a sample only (:func:`mmvl.models.modules.vlm_parts.packed_attention_mask`).
A sample's first token is never a label: the token before it belongs to another sample. The image
tensors of the batch are the samples' own images, in the order their placeholders appear in the
rows (row by row), none for a text-only sample: the model places them at its placeholders in that
order. The loss is the token-normalised ``answer_tokens`` over the update, so packing changes no
weighting: one update on packed rows computes what the padded batch does.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mmvl.errors import UserError
from mmvl.labels import IGNORE_INDEX


def plan_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """The samples (indices into ``lengths``) of each row: as few rows as the tokens need, balanced.
    Deterministic: the same lengths give the same rows (a resumed run packs as the first did)."""
    if any(n > capacity for n in lengths):
        longest = max(lengths)
        raise UserError(f"training.packing: a sample of {longest} tokens is longer than the rows' {capacity}; "
                        "raise the text processor's max_length (it caps every sample) to at least it.")
    rows: list[list[int]] = [[] for _ in range(max(1, -(-sum(lengths) // capacity)))]
    filled = [0] * len(rows)
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        fits = [r for r in range(len(rows)) if filled[r] + lengths[i] <= capacity]
        if not fits:
            rows.append([])
            filled.append(0)
            fits = [len(rows) - 1]
        r = min(fits, key=lambda k: (filled[k], k))
        rows[r].append(i)
        filled[r] += lengths[i]
    return [sorted(row) for row in rows if row]  # within a row, the sampler's order


def sample_images(item: dict[str, Any], image_token_id: int, image_tokens: int) -> list[torch.Tensor]:
    """The images ``item`` places (``image``: one ``C x H x W`` or ``k x C x H x W``); a text-only
    sample's blank image is none of them."""
    placed = int(item["input_ids"].eq(image_token_id).sum()) // max(1, image_tokens)
    image = item.get("image")
    if not placed or not isinstance(image, torch.Tensor):
        return []
    return [image] if image.dim() == 3 else list(image[:placed])


def pack(items: Sequence[dict[str, Any]], *, capacity: int, pad_id: int, image_token_id: int,
         image_tokens: int) -> dict[str, Any]:
    """The packed batch of ``items`` (samples with 1-D ``input_ids`` and ``targets``, and ``image``):
    ``input_ids``, ``targets`` and ``position_ids`` (rows x the longest row), ``image`` (every placed
    image, ``N x C x H x W``: at least one, a text-only batch's blank placed nowhere, so the image
    encoder runs in every forward as it does on padded batches), ``id`` (the samples, row by row)."""
    lengths = [int(item["input_ids"].numel()) for item in items]
    rows = plan_rows(lengths, capacity)
    width = max(sum(lengths[i] for i in row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    images: list[torch.Tensor] = []
    order = []
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            n, item = lengths[i], items[i]
            ids[r, at: at + n] = item["input_ids"]
            targets[r, at: at + n] = item["targets"]
            targets[r, at] = IGNORE_INDEX  # predicted from the previous sample's last token: never a label
            positions[r, at: at + n] = torch.arange(n)
            images += sample_images(item, image_token_id, image_tokens)
            order.append(item.get("id", i))
            at += n
        positions[r, at:] = torch.arange(width - at)  # the padding: a sequence of its own, never a label
    if not images:
        blank = next((item["image"] for item in items if isinstance(item.get("image"), torch.Tensor)), None)
        if blank is not None:
            images = [blank if blank.dim() == 3 else blank[0]]
    batch: dict[str, Any] = {"input_ids": ids, "targets": targets, "position_ids": positions, "id": order}
    if images:
        batch["image"] = torch.stack(images)
    return batch
