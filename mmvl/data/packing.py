"""Padding-free packing (``training.packing``): a micro-batch's samples share rows instead of each
padding to the longest.

The samples are the sampler's, unchanged (order and resume stay as they are); only where they sit
changes. Rows hold up to ``capacity`` tokens (None: one row holds them all) and are balanced
(longest sample first, each into the row with the fewest tokens that still has room), so they end
close together and little is padded. Each sample's positions restart at 0 (``position_ids``), and
``segments`` say where each sample sits, so the model attends within a sample only
(:func:`mmvl.models.modules.vlm_parts.lm_packed_inputs`). A sample's first token is never a label:
the token before it belongs to another sample. The image tensors of the batch are the samples' own
images, in the order their placeholders appear (row by row), none for a text-only sample: the model
places them at its placeholders in that order. The loss is the token-normalised ``answer_tokens``
over the update, so packing changes no weighting: one update on packed rows computes what the
padded batch does.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
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


def placed_images(rows: list[list[dict[str, Any]]], *, image_token_id: int, image_tokens: int) -> dict[str, Any]:
    """``image``: every image the rows' samples place, ``N x C x H x W``, in their order (mmvl's own
    ``vlm``); a batch without any: one text-only sample's blank, placed nowhere, so the image encoder
    runs in every forward as it does on padded batches."""
    images = [image for row in rows for item in row for image in sample_images(item, image_token_id, image_tokens)]
    if not images:
        blank = next((item["image"] for row in rows for item in row if isinstance(item.get("image"), torch.Tensor)),
                     None)
        if blank is None:
            return {}
        images = [blank if blank.dim() == 3 else blank[0]]
    return {"image": torch.stack(images)}


#: a bucket of samples padded to its longest may compute up to this times their own attention squares
BUCKET_WASTE = 1.3


def attention_buckets(spans: Sequence[tuple[int, int]]) -> dict[str, Any]:
    """Where attention computes for packed rows: the samples (``(first flat position, length)`` in the
    rows flattened) in buckets of similar length. ``buckets``: per bucket a
    ``samples x longest`` index of flat positions, right-padded with position 0 (one causal attention
    call a bucket is exact for each sample: a real position never attends a right pad); ``slots``: the
    real entries of the buckets' outputs laid end to end, ``positions``: the flat position each goes
    back to. A bucket computes at most :data:`BUCKET_WASTE` times its samples' own squares."""
    order = sorted(range(len(spans)), key=lambda k: (-spans[k][1], k))
    groups: list[list[int]] = []
    for i in order:
        if groups:
            current = groups[-1]
            longest = spans[current[0]][1]
            own = sum(spans[k][1] ** 2 for k in current) + spans[i][1] ** 2
            if longest ** 2 * (len(current) + 1) <= BUCKET_WASTE * own:
                current.append(i)
                continue
        groups.append([i])
    buckets, slots, positions, at = [], [], [], 0
    for group in groups:
        longest = spans[group[0]][1]
        index = torch.zeros((len(group), longest), dtype=torch.long)
        for j, k in enumerate(group):
            start, n = spans[k]
            index[j, :n] = torch.arange(start, start + n)
            slots.append(torch.arange(at + j * longest, at + j * longest + n))
            positions.append(index[j, :n])
        buckets.append(index)
        at += len(group) * longest
    return {"buckets": buckets, "slots": torch.cat(slots), "positions": torch.cat(positions)}


def _per_token_keys(item: dict[str, Any]) -> list[str]:
    """The keys of ``item`` holding one value a token (``input_ids``, ``targets``, a processor's
    ``token_type_ids``, ...), its ``attention_mask`` aside: packed rows need none."""
    n = item["input_ids"].numel()
    return [k for k, v in item.items() if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == n
            and k != "attention_mask"]


def pack(items: Sequence[dict[str, Any]], *, capacity: int | None, pad_id: int,
         images: Callable[[list[list[dict[str, Any]]]], dict[str, Any]]) -> dict[str, Any]:
    """The packed batch of ``items`` (samples with 1-D ``input_ids`` and ``targets``): their per-token
    keys and ``position_ids`` (rows x the longest row; ``input_ids`` padded with ``pad_id``, ``targets``
    with -100, the rest with 0), ``segments`` (where each sample sits, for attention that computes each
    sample's own square: :func:`attention_buckets`), ``id`` (the samples, row by row) and what ``images`` makes of the
    rows' samples (the image tensors, in the order their placeholders appear, row by row).
    ``capacity`` None: one row of every sample (nothing padded)."""
    lengths = [int(item["input_ids"].numel()) for item in items]
    rows = plan_rows(lengths, capacity or sum(lengths))
    width = max(sum(lengths[i] for i in row) for row in rows)
    pads = {"input_ids": pad_id, "targets": IGNORE_INDEX}
    batch: dict[str, Any] = {key: torch.full((len(rows), width), pads.get(key, 0), dtype=items[0][key].dtype)
                             for key in _per_token_keys(items[0])}
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    order, segments = [], []
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            n, item = lengths[i], items[i]
            for key in batch:
                batch[key][r, at: at + n] = item[key]
            batch["targets"][r, at] = IGNORE_INDEX  # predicted from the previous sample's last token: never a label
            positions[r, at: at + n] = torch.arange(n)
            order.append(item.get("id", i))
            segments.append((r * width + at, n))
            at += n
        positions[r, at:] = torch.arange(width - at)  # the padding: a sequence of its own, never a label
    batch.update(position_ids=positions, segments=attention_buckets(segments), id=order)
    batch.update(images([[items[i] for i in row] for row in rows]))
    return batch
