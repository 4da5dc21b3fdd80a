"""WebDataset tar shards of image-text pairs: list them, count them, read them, plan an epoch.

A shard is a plain tar of samples ``{key}.jpg|jpeg|png|webp`` + ``{key}.txt|json`` (what
img2dataset writes). Training streams them: each rank reads its own shards, each DataLoader
worker a share of those, in bounded memory (one shuffle buffer of raw bytes per worker).

Why resuming needs no more than ``{epoch, batch}``: everything an epoch does is a pure function
of ``(seed, epoch, rank, world_size, workers, shard sample counts)``: the shard order, which
worker reads which shards, how many batches each worker gives and the order its shuffle buffer
emits samples in (the buffer's draws depend only on how many samples passed, never on their
bytes, so the emission order is computed on integers). Worker ``w``'s ``j``-th batch is always
emissions ``[j*B, (j+1)*B)`` of its stream (a corrupt image makes that batch one smaller instead
of borrowing a later sample), so the position after ``k`` batches of a rank follows from ``k``:
a resumed worker skips the shards it has fully emitted without opening them and re-reads only
the shards still present in its buffer, decoding nothing it skips.

Only this module imports ``webdataset`` (its tar reading); shards are never unpickled (``.pyd``
members are ignored).
"""
from __future__ import annotations

import heapq
import io
import json
import logging
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from mmvl.errors import UserError

log = logging.getLogger("mmvl")

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
TEXT_EXTS = ("txt", "json")


def require_webdataset() -> None:
    """A missing ``webdataset`` package is one clear error, before any shard is touched."""
    try:
        import braceexpand  # noqa: F401
        import webdataset  # noqa: F401
    except ImportError:
        raise UserError("reading or writing shards needs the webdataset package: pip install 'mmvl[shards]' "
                        "(or pip install webdataset).") from None


# -- listing and counting --------------------------------------------------------------------------
def expand_shards(spec: str | Sequence[str], resolve: Callable[[str], Path], dataset: str,
                  where: str) -> list[Path]:
    """The shard files a brace pattern (``train-{000000..000009}.tar``) or a list of them names,
    each resolved by ``resolve``; a missing shard is one UserError naming it."""
    require_webdataset()
    from braceexpand import braceexpand

    patterns = [spec] if isinstance(spec, str) else [str(s) for s in (spec or [])]
    paths = [resolve(name) for pattern in patterns for name in braceexpand(pattern)]
    if not paths:
        raise UserError(f"{dataset}: {where} names no shard; give a brace pattern such as "
                        "'train-{000000..000009}.tar' or a list of .tar files.")
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise UserError(f"{dataset}: shard {str(missing[0])!r} does not exist ({len(missing)} of {len(paths)} "
                        f"shards in {where} are missing); check the pattern and env.data_dir, or write the shards "
                        "with mmvl_shards.")
    return paths


def split_name(name: str) -> tuple[str | None, str]:
    """``(key, extension)`` of a tar member name, as webdataset groups them."""
    from webdataset.tariterators import base_plus_ext

    key, ext = base_plus_ext(name)
    return key, (ext or "").lower()


def complete(exts: Iterable[str]) -> bool:
    """Whether a sample with these extensions is an image-text pair."""
    found = set(exts)
    return bool(found & set(IMAGE_EXTS)) and bool(found & set(TEXT_EXTS))


def members_by_key(path: Path, dataset: str) -> list[dict[str, tarfile.TarInfo]]:
    """The regular members of ``path`` grouped by sample key (extension -> member), in file order,
    from the tar headers alone (an uncompressed tar is read header to header)."""
    groups: list[dict[str, tarfile.TarInfo]] = []
    key = None
    try:
        with tarfile.open(path, mode="r:") as tar:
            for member in tar:
                if not member.isreg():
                    continue
                k, ext = split_name(member.name)
                if k != key or not groups:
                    groups.append({})
                    key = k
                groups[-1][ext] = member
    except (tarfile.TarError, OSError) as e:
        raise UserError(f"{dataset}: shard {str(path)!r} is not a readable tar file ({e}); write it again.") from None
    return groups


def count_samples(path: Path, dataset: str) -> int:
    """How many complete image-text samples ``path`` holds."""
    return sum(complete(group) for group in members_by_key(path, dataset))


# -- reading (webdataset) ------------------------------------------------------------------------------
def raw_samples(path: Path) -> Iterator[dict[str, Any]]:
    """The complete samples of one shard in file order: ``{"__key__", <ext>: bytes, ...}``.

    A shard that breaks off part-way (a truncated copy) ends there with a warning; what was read
    before is kept."""
    from webdataset.tariterators import group_by_keys, tar_file_iterator

    def stop(exn: Exception) -> bool:
        log.warning("shard %s is damaged (%s); reading stops there", path, exn)
        return False

    with open(path, "rb") as f:
        files = ({**item, "__url__": str(path)} for item in tar_file_iterator(f, handler=stop))
        for sample in group_by_keys(files, handler=stop):
            if complete(k for k in sample if not k.startswith("__")):
                yield sample


def caption_of(sample: dict[str, Any]) -> str:
    """The text of a sample: its ``.txt``, else the ``caption`` (or ``text``) field of its ``.json``."""
    if "txt" in sample:
        return bytes(sample["txt"]).decode("utf-8").strip()
    meta = json.loads(bytes(sample["json"]).decode("utf-8"))
    text = meta.get("caption", meta.get("text")) if isinstance(meta, dict) else None
    if text is None:
        raise ValueError(f"sample {sample['__key__']!r}: its .json has no 'caption' or 'text' field")
    return str(text)


def decode_sample_image(sample: dict[str, Any]) -> Any:
    """An RGB PIL image from the sample's image bytes; OSError/ValueError when they cannot be decoded."""
    from PIL import Image

    ext = next(e for e in IMAGE_EXTS if e in sample)
    with Image.open(io.BytesIO(bytes(sample[ext]))) as img:
        img.load()
        return img.convert("RGB")


# -- the deterministic shuffle ---------------------------------------------------------------------------
class ShuffleOrder:
    """The order a shuffle buffer of ``size`` emits inputs ``0..n-1`` in, computed on the ids alone.

    The buffer fills up, then each new input takes the slot of a uniformly drawn one, which is
    emitted; at the end the rest leave in random order. ``size`` <= 1 keeps the input order.
    ``held`` (the ids in the buffer) and ``next_input`` say which inputs are still to come."""

    def __init__(self, n: int, size: int, rng: np.random.Generator):
        self.n, self.size, self.rng = n, max(1, int(size)), rng
        self.held: list[int] = []
        self.next_input = 0
        self._draining = False

    def __iter__(self) -> "ShuffleOrder":
        return self

    def __next__(self) -> int:
        while self.next_input < self.n:
            i, self.next_input = self.next_input, self.next_input + 1
            if len(self.held) < self.size:
                self.held.append(i)
                continue
            j = int(self.rng.integers(self.size))
            out, self.held[j] = self.held[j], i
            return out
        if not self._draining:  # from here on ``held`` is the rest, last-out first
            self._draining = True
            self.held = [self.held[int(j)] for j in self.rng.permutation(len(self.held))][::-1]
        if not self.held:
            raise StopIteration
        return self.held.pop()


# -- the epoch plan ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class EpochPlan:
    """One rank's epoch: each worker's shards and its number of batches, and what the epoch drops."""

    shards: list[list[int]]  # per worker: shard indices, in reading order
    batches: list[int]  # per worker: batches it gives this epoch
    per_rank: int  # batches every rank runs
    dropped: int  # samples of the epoch no rank uses (all ranks together)

    def order(self) -> list[int]:
        """The worker of each batch, in the order a DataLoader returns them (round robin, skipping
        workers that are done)."""
        left, out = list(self.batches), []
        while len(out) < self.per_rank:
            for w, n in enumerate(left):
                if n:
                    out.append(w)
                    left[w] -= 1
        return out

    def done(self, batch: int) -> list[int]:
        """How many batches each worker has given after the rank's first ``batch``."""
        counts = [0] * len(self.batches)
        for w in self.order()[:batch]:
            counts[w] += 1
        return counts


def plan_epoch(counts: Sequence[int], *, seed: int, epoch: int, rank: int, world_size: int, workers: int,
               batch_size: int) -> EpochPlan:
    """Which shards each worker of ``rank`` reads this epoch, and how many batches each gives.

    The shards are dealt to the ``world_size x workers`` readers largest first, each to the reader
    holding the fewest samples so far (ties: the lower reader, readers interleaved over ranks), and
    shards of equal size in the order drawn from ``(seed, epoch)``. So which shard goes where changes
    every epoch, but each reader's number of samples, hence every batch count and what is dropped,
    depends on the shard sizes alone: the same in every epoch, on every rank. (A plain round robin
    over the shuffled shards gives the short last shard to another reader each epoch, so the batches
    per rank change from epoch to epoch, and a consumer that counts ``batches_per_epoch`` batches
    per epoch reads into the next one.) Every rank runs as many batches as the poorest one has."""
    order = np.random.default_rng([seed, epoch, 24]).permutation(len(counts)).tolist()
    slots = world_size * workers  # reader k is worker k // world_size of rank k % world_size
    held: list[list[int]] = [[] for _ in range(slots)]
    heap = [(0, k) for k in range(slots)]
    for place, s in sorted(enumerate(order), key=lambda ps: (-int(counts[ps[1]]), ps[0])):
        total, k = heapq.heappop(heap)
        held[k].append(place)
        heapq.heappush(heap, (total + int(counts[s]), k))

    def split(r: int) -> list[list[int]]:  # each worker reads its shards in the epoch's order
        return [[order[place] for place in sorted(held[w * world_size + r])] for w in range(workers)]

    quotas = [[sum(counts[s] for s in shards) // batch_size for shards in split(r)] for r in range(world_size)]
    per_rank = min(sum(q) for q in quotas)
    mine, left = quotas[rank], per_rank
    taken = [0] * workers
    while left:  # round robin over the workers that still have batches
        for w in range(workers):
            if left and taken[w] < mine[w]:
                taken[w] += 1
                left -= 1
    return EpochPlan(split(rank), taken, per_rank, int(sum(counts)) - per_rank * batch_size * world_size)


# -- one worker's batches --------------------------------------------------------------------------
def worker_samples(paths: Sequence[Path], counts: Sequence[int], shards: Sequence[int], *, buffer_size: int,
                   rng: np.random.Generator, start: int, stop: int) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """Emissions ``[start, stop)`` of a worker's shuffled stream: ``(shard, offset in shard, raw sample)``.

    Shards whose samples were all emitted before ``start`` are not opened; held in memory are at most
    the ``buffer_size`` samples the buffer holds."""
    firsts = np.cumsum([0] + [counts[s] for s in shards])  # the worker's first id of each of its shards
    order = ShuffleOrder(int(firsts[-1]), buffer_size, rng)
    for _ in range(start):
        next(order)
    needed, resumed_at = set(order.held), order.next_input  # still to emit: these and every id from resumed_at
    needed_from = min(needed | {resumed_at})
    store: dict[int, dict[str, Any]] = {}

    def read() -> Iterator[tuple[int, dict[str, Any]]]:
        for n, s in enumerate(shards):
            if firsts[n + 1] <= needed_from:
                continue  # every sample of this shard was emitted before the resume point
            for offset, sample in enumerate(raw_samples(paths[s])):
                if offset >= counts[s]:
                    break
                yield int(firsts[n]) + offset, sample

    reader = read()
    for _ in range(stop - start):
        wanted = next(order, None)
        if wanted is None:
            return
        while wanted not in store:
            got = next(reader, None)
            if got is None:
                raise UserError(f"a shard of {[str(paths[s]) for s in shards]} holds fewer samples than its "
                                "headers counted; it changed while training, write it again.")
            if got[0] >= resumed_at or got[0] in needed:
                store[got[0]] = got[1]
        n = int(np.searchsorted(firsts, wanted, side="right")) - 1
        yield shards[n], wanted - int(firsts[n]), store.pop(wanted)
