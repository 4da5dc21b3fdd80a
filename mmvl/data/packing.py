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


def placed_images(rows: list[list[dict[str, Any]]], *, image_token_id: int, image_tokens: int) -> dict[str, Any]:
    """``image``: every image the rows' samples place, ``N x C x H x W``, in their order (mmvl's own
    ``vlm``): a sample's ``image`` (one ``C x H x W`` or ``k x C x H x W``) gives as many as its
    placeholders ask for, a text-only sample's blank none. A batch without any: one text-only sample's
    blank, placed nowhere, so the image encoder runs in every forward as it does on padded batches."""
    items = [item for row in rows for item in row]
    owner = torch.repeat_interleave(torch.arange(len(items)), torch.tensor([item["input_ids"].numel() for item in items]))
    marks = torch.cat([item["input_ids"] for item in items]).eq(image_token_id)
    placed = (torch.bincount(owner[marks], minlength=len(items)) // max(1, image_tokens)).tolist()
    images = []
    for item, n in zip(items, placed):
        image = item.get("image")
        if n and isinstance(image, torch.Tensor):
            images += [image] if image.dim() == 3 else list(image[:n])
    if not images:
        blank = next((item["image"] for item in items if isinstance(item.get("image"), torch.Tensor)), None)
        if blank is None:
            return {}
        images = [blank if blank.dim() == 3 else blank[0]]
    return {"image": torch.stack(images)}


#: what one more attention call costs, as the squared positions attention computes in the same time:
#: CPU sdpa's forward and backward take about 2e-5 ms a squared position (4 heads of 32) and about
#: 0.1 ms a call, however small (measured on 2 cores, torch 2.14); fewer, fuller buckets pay it less
BUCKET_CALL = 64 * 64


def _within(sizes: torch.Tensor) -> torch.Tensor:
    """Each position's offset within its segment, for segments of ``sizes`` laid end to end."""
    return torch.arange(int(sizes.sum())) - torch.repeat_interleave(sizes.cumsum(0) - sizes, sizes)


def bucket_groups(lengths: Sequence[int], call: int | None = None) -> list[list[int]]:
    """The samples (indices into ``lengths``) of each bucket, longest first: the split of the samples
    sorted by length into runs that computes least, each run costing ``samples x longest ** 2 + call``
    (a bucket pads its samples to its longest; ``call`` None: :data:`BUCKET_CALL`). Exact (dynamic
    programming over the sorted lengths) and deterministic."""
    call = BUCKET_CALL if call is None else call
    order = sorted(range(len(lengths)), key=lambda k: (-lengths[k], k))
    best, cut = [0] + [-1] * len(order), [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        for start in range(end):
            cost = best[start] + (end - start) * lengths[order[start]] ** 2 + call
            if best[end] < 0 or cost < best[end]:
                best[end], cut[end] = cost, start
    groups, end = [], len(order)
    while end:
        groups.append(order[cut[end]: end])
        end = cut[end]
    return groups[::-1]


def attention_buckets(spans: Sequence[tuple[int, int]], total: int | None = None) -> dict[str, Any]:
    """Where attention computes for packed rows of ``total`` positions (default: up to the last span's
    end): the samples (``(first flat position, length)`` in the rows flattened) in buckets of similar
    length (:func:`bucket_groups`), each bucket ``samples x longest``, laid end to end. ``shapes``: each
    bucket's ``(samples, longest)``; ``gather``: the flat position of each bucket slot (a right pad:
    position 0; one causal call a bucket is exact for each sample, as a real position never attends a
    right pad); ``scatter``: the slot of each flat position (a row's padding: slot 0); ``pad_slots``
    and ``row_pads``: the slots and positions that are padding, whose values and gradients are zeros."""
    groups = bucket_groups([n for _, n in spans])
    total = max(start + n for start, n in spans) if total is None else total
    shapes = [(len(group), spans[group[0]][1]) for group in groups]
    slot_starts, at = [], 0  # each sample's first slot, in bucket order
    for group, (_, longest) in zip(groups, shapes):
        slot_starts += range(at, at + len(group) * longest, longest)
        at += len(group) * longest
    order = [k for group in groups for k in group]
    lengths = torch.tensor([spans[k][1] for k in order])
    offset = _within(lengths)
    slots = torch.repeat_interleave(torch.tensor(slot_starts, dtype=torch.long), lengths) + offset
    flat = torch.repeat_interleave(torch.tensor([spans[k][0] for k in order], dtype=torch.long), lengths) + offset
    gather, real = torch.zeros(at, dtype=torch.long), torch.zeros(at, dtype=torch.bool)
    scatter, covered = torch.zeros(total, dtype=torch.long), torch.zeros(total, dtype=torch.bool)
    gather[slots], real[slots], scatter[flat], covered[flat] = flat, True, slots, True
    return {"shapes": shapes, "gather": gather, "scatter": scatter, "pad_slots": real.logical_not().nonzero().view(-1),
            "row_pads": covered.logical_not().nonzero().view(-1)}


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
        sizes = torch.tensor([lengths[i] for i in row])
        starts = sizes.cumsum(0) - sizes
        used = int(sizes.sum())
        for key, column in batch.items():
            column[r, :used] = torch.cat([items[i][key] for i in row])
        batch["targets"][r, starts] = IGNORE_INDEX  # predicted from the previous sample's last token: never a label
        positions[r, :used] = _within(sizes)  # restarting per sample
        positions[r, used:] = torch.arange(width - used)  # the padding: a sequence of its own, never a label
        order += [items[i].get("id", i) for i in row]
        segments += [(r * width + int(at), lengths[i]) for i, at in zip(row, starts.tolist())]
    batch.update(position_ids=positions, segments=attention_buckets(segments, len(rows) * width), id=order)
    batch.update(images([[items[i] for i in row] for row in rows]))
    return batch
