"""Data loaders that know their position, so a run can resume mid-epoch exactly.

The sampler is a seeded function of (seed, epoch): resuming needs only the
epoch and how many batches of it were consumed, never a replay of the data.
One DataLoader serves every epoch (with ``persistent_workers`` its workers too):
each epoch re-arms the sampler and re-iterates the loader.
Its rank split matches ``DistributedSampler`` (indices ``rank::world_size``),
so a global batch at world size W holds the same samples as at world size 1.

``training.group_by_length`` (LLaVA's ``group_by_modality_length``, Hugging Face's
``group_by_length``): each global batch is drawn from samples of similar length, so a batch pads
little; :func:`sample_lengths` reads the lengths a dataset declares.

Every worker starts by freezing the objects it inherited (:func:`freeze_inherited`).
"""
from __future__ import annotations

import gc
import math
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from mmvl.errors import UserError




def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of ``epoch``'s sample order: one value per (seed, epoch), the same on every rank."""
    return (int(seed) * 1000003 + int(epoch)) % 2**63


def worker_seed(seed: int, epoch: int, rank: int) -> int:
    """The seed of the generator that seeds ``rank``'s DataLoader workers in ``epoch``."""
    return (epoch_seed(seed, epoch) * 101 + int(rank)) % 2**63


def freeze_inherited(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: move every object inherited from the main process out of the
    worker's garbage collector (``gc.freeze``).

    A forked worker shares the main process's memory until it writes to it. Its first full
    collection writes the header of every container object it inherited (the whole Python
    heap: modules, the model, the datasets' objects), copying all those pages into the worker,
    tens to hundreds of MB per worker. Frozen objects are never visited; the worker's own
    garbage is still collected.
    """
    gc.freeze()


def resolve_pin_memory(value: Any, device: torch.device) -> bool:
    """``training.pin_memory``: ``auto`` pins exactly when batches go to a CUDA device (page-locked
    host memory is what lets the copy run asynchronously, overlapping compute)."""
    if value == "auto":
        return device.type == "cuda"
    if isinstance(value, bool):
        return value
    raise UserError(f"training.pin_memory={value!r} is not one of auto, true, false; use auto "
                    "(pin when training on CUDA).")


class ResumableSampler(Sampler[int]):
    """This rank's indices for one epoch, optionally starting part-way through.

    With ``tag_epoch`` it yields ``(epoch, index)`` pairs (see :class:`EpochTagged`).
    """

    def __init__(self, size: int, *, shuffle: bool, seed: int, rank: int = 0,
                 world_size: int = 1, drop_last: bool = False, tag_epoch: bool = False,
                 lengths: torch.Tensor | None = None, batch_size: int = 1):
        self.size, self.shuffle, self.seed = size, shuffle, seed
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        self.epoch, self.start, self.tag_epoch = 0, 0, tag_epoch
        if lengths is not None and not (shuffle and drop_last):
            raise ValueError("length grouping is for shuffled training orders (shuffle and drop_last)")
        self.lengths, self.global_batch = lengths, batch_size * world_size  # lengths: group by length

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Select ``epoch``; skip the first ``start`` indices of this rank's share."""
        self.epoch, self.start = epoch, start

    def _indices(self) -> torch.Tensor:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.size, generator=g)
        else:
            order = torch.arange(self.size)
        w = self.world_size
        if self.drop_last:
            order = order[: self.size // w * w]
            if self.lengths is not None:
                order = group_by_length(order, self.lengths, self.global_batch, g)
        elif self.size % w:
            pad = math.ceil(self.size / w) * w - self.size
            order = torch.cat([order, order[:pad].repeat(math.ceil(pad / max(1, self.size)))[:pad]])
        return order[self.rank::w]

    def per_rank(self) -> int:
        return self.size // self.world_size if self.drop_last else math.ceil(self.size / self.world_size)

    def __iter__(self) -> Iterator[Any]:
        indices = self._indices()[self.start:].tolist()
        return iter([(self.epoch, i) for i in indices] if self.tag_epoch else indices)

    def __len__(self) -> int:
        return max(0, self.per_rank() - self.start)


#: global batches per window of the shuffled order that :func:`group_by_length` sorts
GROUP_WINDOW = 50


def group_by_length(order: torch.Tensor, lengths: torch.Tensor, global_batch: int,
                    generator: torch.Generator) -> torch.Tensor:
    """``order`` (shuffled) regrouped so that each run of ``global_batch`` positions holds samples
    of similar length: every window of :data:`GROUP_WINDOW` global batches is sorted by length
    (longest first) and cut into batches, then the epoch's batches are shuffled, so neither a
    batch's place in the epoch nor its neighbours follow its length. The tail short of a whole
    global batch stays last (the loader drops it). Only the order changes: every index is kept."""
    whole = len(order) // global_batch * global_batch
    head, tail = order[:whole], order[whole:]
    window = global_batch * GROUP_WINDOW
    parts = [part[torch.argsort(lengths[part], descending=True, stable=True)] for part in head.split(window)]
    batches = torch.cat(parts).view(-1, global_batch)
    batches = batches[torch.randperm(len(batches), generator=generator)]
    return torch.cat([batches.reshape(-1), tail])


def sample_lengths(dataset: Dataset, name: str) -> torch.Tensor:
    """The lengths ``dataset.sample_lengths()`` declares (about a sample's tokens, image tokens
    included: only their order matters), one per sample, checked."""
    declare = getattr(dataset, "sample_lengths", None)
    if not callable(declare):
        raise UserError(f"training.group_by_length=true, but dataset {name!r} declares no sample lengths; "
                        "set training.group_by_length=false, or give its dataset a sample_lengths() method.")
    lengths = torch.as_tensor(list(declare()), dtype=torch.long)
    if lengths.dim() != 1 or len(lengths) != len(dataset):  # type: ignore[arg-type]
        raise UserError(f"dataset {name!r}: sample_lengths() gave {tuple(lengths.shape)} lengths for "  # type: ignore[arg-type]
                        f"{len(dataset)} samples; return one length a sample.")  # type: ignore[arg-type]
    return lengths


class EpochTagged(Dataset):
    """``dataset[i]`` for the index ``(epoch, i)``, after ``dataset.set_epoch(epoch)`` when the epoch changed.

    A dataset with per-epoch randomness (``set_epoch``) learns the epoch from its indices,
    so the copies in DataLoader workers follow it too (persistent workers are started once
    and never see the main process call ``set_epoch``).
    """

    def __init__(self, dataset: Dataset):
        self.dataset = dataset
        self._epoch: int | None = None

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        if epoch != self._epoch:
            self.dataset.set_epoch(epoch)  # type: ignore[attr-defined]
            self._epoch = epoch
        return self.dataset[index]


class EpochStream:
    """The cursor every training stream shares: an endless ``next()`` over one DataLoader re-armed
    at each epoch, at ``{epoch, batch}`` (the epoch in progress and how many of its
    ``batches_per_epoch`` batches this rank has consumed), which is all its state.

    A subclass sets ``loader``, ``batches_per_epoch``, ``seed``, ``rank`` and ``_generator`` (the
    loader's), and ``_arm()`` points its loader at the current position. The worker seeds come from
    the generator re-seeded per (seed, epoch, rank), so a fresh start of an epoch (a resume, or
    workers that are not persistent) seeds them as an uninterrupted run did. Persistent workers are
    seeded once, when they start."""

    loader: DataLoader
    batches_per_epoch: int
    seed: int
    rank: int
    epoch: int = 0
    batch: int = 0
    _generator: torch.Generator
    _iter: Iterator[Any] | None = None

    def _arm(self) -> None:
        raise NotImplementedError

    def _start_epoch(self) -> None:
        self._arm()
        self._generator.manual_seed(worker_seed(self.seed, self.epoch, self.rank))
        self._iter = iter(self.loader)

    def __next__(self) -> Any:
        if self._iter is None:
            self._start_epoch()
        if self.batch >= self.batches_per_epoch:
            self.epoch, self.batch = self.epoch + 1, 0
            self._start_epoch()
        batch = next(self._iter)
        self.batch += 1
        return batch

    def __iter__(self) -> "EpochStream":
        return self


class TrainStream(EpochStream):
    """An endless stream of training batches of a map-style dataset that crosses epochs and can be
    resumed from ``state_dict()``, ``{epoch, batch}`` (see :class:`EpochStream`)."""

    def __init__(self, dataset: Dataset, *, batch_size: int, collate_fn: Callable,
                 seed: int, rank: int, world_size: int, num_workers: int = 0,
                 pin_memory: bool = False, persistent_workers: bool = False, name: str = "dataset",
                 group_by_length: bool = False):
        self.dataset, self.batch_size, self.collate_fn = dataset, batch_size, collate_fn
        self.seed, self.rank, self.num_workers, self.pin_memory = seed, rank, num_workers, pin_memory
        per_epoch = callable(getattr(dataset, "set_epoch", None))  # per-epoch sample randomness (e.g. masking)
        lengths = sample_lengths(dataset, name) if group_by_length else None
        self.sampler = ResumableSampler(len(dataset), shuffle=True, seed=seed, rank=rank,
                                        world_size=world_size, drop_last=True, tag_epoch=per_epoch,
                                        lengths=lengths, batch_size=batch_size)
        self._generator = torch.Generator()
        self.loader = DataLoader(EpochTagged(dataset) if per_epoch else dataset, batch_size=batch_size,
                                 sampler=self.sampler, collate_fn=collate_fn, num_workers=num_workers,
                                 pin_memory=pin_memory, drop_last=True, generator=self._generator,
                                 persistent_workers=bool(persistent_workers) and num_workers > 0,
                                 worker_init_fn=freeze_inherited if num_workers else None)
        self.batches_per_epoch = self.sampler.per_rank() // batch_size
        if self.batches_per_epoch == 0:
            raise UserError(
                f"Dataset {name!r} has {len(dataset)} training samples, fewer than one global batch "
                f"({batch_size * world_size}); lower training.batch_size or add data.")
        self.epoch, self.batch = 0, 0
        self._iter: Iterator[Any] | None = None

    def _arm(self) -> None:
        """This epoch's order from the current position (the sampler is read when the loader is
        iterated, in this process, also with persistent workers)."""
        self.sampler.set_epoch(self.epoch, start=self.batch * self.batch_size)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])
        if self.batch > self.batches_per_epoch:
            raise UserError(
                f"Checkpoint data position (batch {self.batch} of epoch {self.epoch}) is past the end "
                f"of this dataset's epoch ({self.batches_per_epoch} batches); the dataset or "
                "batch size changed since the checkpoint was saved.")
        self._iter = None


def eval_loader(dataset: Dataset, *, batch_size: int, collate_fn: Callable, rank: int,
                world_size: int, num_workers: int = 0, pin_memory: bool = False) -> DataLoader:
    """Sequential, rank-sharded loader; evaluation drops the sampler's padded duplicates itself.

    Its own generator: iterating a DataLoader draws a seed for its workers, from the global RNG
    when it has none, and that draw moved every later dropout mask of the training run, so a run
    trained differently with another evaluation_interval (benchmarks/parity.py, --evaluate-every)."""
    sampler = ResumableSampler(len(dataset), shuffle=False, seed=0, rank=rank,
                               world_size=world_size, drop_last=False)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                      num_workers=num_workers, pin_memory=pin_memory, generator=torch.Generator().manual_seed(0),
                      worker_init_fn=freeze_inherited if num_workers else None)
