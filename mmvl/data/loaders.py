"""Data loaders that know their position, so a run can resume mid-epoch exactly.

The sampler is a seeded function of (seed, epoch): resuming needs only the
epoch and how many batches of it were consumed, never a replay of the data.
Its rank split matches ``DistributedSampler`` (indices ``rank::world_size``),
so a global batch at world size W holds the same samples as at world size 1.

Every worker starts by freezing the objects it inherited (:func:`freeze_inherited`).
"""
from __future__ import annotations

import gc
import math
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from mmvl.errors import UserError


def freeze_inherited(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: move every object inherited from the main process out of the
    worker's garbage collector (``gc.freeze``).

    A forked worker shares the main process's memory until it writes to it. Its first full
    collection writes the header of every container object it inherited (the whole Python
    heap: modules, the model, the datasets' objects), copying all those pages into the worker,
    tens to hundreds of MB per worker, once per worker and epoch. Frozen objects are never
    visited; the worker's own garbage is still collected.
    """
    gc.freeze()


class ResumableSampler(Sampler[int]):
    """This rank's indices for one epoch, optionally starting part-way through."""

    def __init__(self, size: int, *, shuffle: bool, seed: int, rank: int = 0,
                 world_size: int = 1, drop_last: bool = False):
        self.size, self.shuffle, self.seed = size, shuffle, seed
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        self.epoch, self.start = 0, 0

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
        elif self.size % w:
            pad = math.ceil(self.size / w) * w - self.size
            order = torch.cat([order, order[:pad].repeat(math.ceil(pad / max(1, self.size)))[:pad]])
        return order[self.rank::w]

    def per_rank(self) -> int:
        return self.size // self.world_size if self.drop_last else math.ceil(self.size / self.world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices()[self.start:].tolist())

    def __len__(self) -> int:
        return max(0, self.per_rank() - self.start)


class TrainStream:
    """An endless stream of training batches that crosses epochs and can be resumed.

    ``state_dict()`` gives ``{epoch, batch}``: the epoch in progress and how many
    of its batches this rank has consumed.
    """

    def __init__(self, dataset: Dataset, *, batch_size: int, collate_fn: Callable,
                 seed: int, rank: int, world_size: int, num_workers: int = 0,
                 pin_memory: bool = False, name: str = "dataset"):
        self.dataset, self.batch_size, self.collate_fn = dataset, batch_size, collate_fn
        self.seed, self.rank, self.num_workers, self.pin_memory = seed, rank, num_workers, pin_memory
        self.sampler = ResumableSampler(len(dataset), shuffle=True, seed=seed, rank=rank,
                                        world_size=world_size, drop_last=True)
        self.batches_per_epoch = self.sampler.per_rank() // batch_size
        if self.batches_per_epoch == 0:
            raise UserError(
                f"Dataset {name!r} has {len(dataset)} training samples, fewer than one global batch "
                f"({batch_size * world_size}); lower training.batch_size or add data.")
        self.epoch, self.batch = 0, 0
        self._iter: Iterator[Any] | None = None

    def _start_epoch(self) -> None:
        self.sampler.set_epoch(self.epoch, start=self.batch * self.batch_size)
        if callable(getattr(self.dataset, "set_epoch", None)):  # per-epoch sample randomness (e.g. masking);
            self.dataset.set_epoch(self.epoch)  # set before the loader starts, so its workers copy it
        g = torch.Generator().manual_seed((self.seed * 1000003 + self.epoch) * 101 + self.rank)
        loader = DataLoader(self.dataset, batch_size=self.batch_size, sampler=self.sampler,
                            collate_fn=self.collate_fn, num_workers=self.num_workers,
                            pin_memory=self.pin_memory, drop_last=True, generator=g,
                            worker_init_fn=freeze_inherited if self.num_workers else None)
        self._iter = iter(loader)

    def __next__(self) -> Any:
        if self._iter is None:
            self._start_epoch()
        if self.batch >= self.batches_per_epoch:
            self.epoch, self.batch = self.epoch + 1, 0
            self._start_epoch()
        batch = next(self._iter)
        self.batch += 1
        return batch

    def __iter__(self) -> "TrainStream":
        return self

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
    """Sequential, rank-sharded loader; evaluation drops the sampler's padded duplicates itself."""
    sampler = ResumableSampler(len(dataset), shuffle=False, seed=0, rank=rank,
                               world_size=world_size, drop_last=False)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                      num_workers=num_workers, pin_memory=pin_memory,
                      worker_init_fn=freeze_inherited if num_workers else None)
