"""Training batches streamed from shards, resumable like :class:`~mmvl.data.loaders.TrainStream`.

``ShardSource`` is the ``IterableDataset`` a shard dataset builder returns for ``train``: the
shards, their sample counts and a ``make_batch(raws, epoch)`` that decodes one batch. Its DataLoader
workers build whole batches (``batch_size=None`` in the loader) from the plan of
:func:`mmvl.data.shards.plan_epoch`, so each worker knows exactly which emissions of its stream make
its ``j``-th batch. ``ShardStream`` tells its workers the epoch and the rank's position through a small
shared-memory tensor written before each ``iter(loader)``, which persistent workers read too
(they are started once and never see the main process's attributes change).

State: ``{epoch, batch}`` plus the facts the plan depends on (world size, workers, shard count,
batch size), so a resume under a different layout is one clear error instead of a silent reshuffle.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from mmvl.data.loaders import EpochStream, TrainStream, freeze_inherited
from mmvl.data.shards import EpochPlan, plan_epoch, worker_samples
from mmvl.errors import UserError

log = logging.getLogger("mmvl")


class ShardSource(IterableDataset):
    """The training shards of one dataset; iterated only through :class:`ShardStream`.

    ``make_batch(raws, epoch)`` turns ``[(shard, offset, raw sample)]`` into a collated batch, or
    None when none of its images decodes."""

    def __init__(self, name: str, paths: Sequence[Path], counts: Sequence[int], buffer_size: int,
                 make_batch: Callable[[list[tuple[int, int, dict[str, Any]]], int], Any]):
        self.name, self.paths, self.counts = name, list(paths), [int(c) for c in counts]
        self.buffer_size, self.make_batch = int(buffer_size), make_batch
        self.layout: dict[str, int] = {}
        # epoch, batch of the rank, and the worker that gives its next batch: a DataLoader always asks
        # worker 0 first, so after a resume mid-round its workers play the plan's workers rotated
        self.control = torch.zeros(3, dtype=torch.int64).share_memory_()

    def __len__(self) -> int:
        return sum(self.counts)

    def configure(self, *, seed: int, rank: int, world_size: int, workers: int, batch_size: int) -> None:
        self.layout = {"seed": seed, "rank": rank, "world_size": world_size, "workers": workers,
                       "batch_size": batch_size}

    def plan(self, epoch: int) -> EpochPlan:
        L = self.layout
        return plan_epoch(self.counts, seed=L["seed"], epoch=epoch, rank=L["rank"], world_size=L["world_size"],
                          workers=L["workers"], batch_size=L["batch_size"])

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        epoch, batch, rotation = (int(v) for v in self.control.tolist())
        worker = ((info.id if info is not None else 0) + rotation) % self.layout["workers"]
        plan, size = self.plan(epoch), self.layout["batch_size"]
        first, last = plan.done(batch)[worker], plan.batches[worker]
        rng = np.random.default_rng([self.layout["seed"], epoch, self.layout["rank"], worker, 24])
        samples = worker_samples(self.paths, self.counts, plan.shards[worker], buffer_size=self.buffer_size,
                                 rng=rng, start=first * size, stop=last * size)
        for j in range(first, last):
            raws = [next(samples) for _ in range(size)]
            out = self.make_batch(raws, epoch)
            if out is None:
                raise UserError(f"{self.name}: no image of a whole batch decodes (shards "
                                f"{sorted({str(self.paths[s]) for s, _, _ in raws})}); they are damaged, write "
                                "them again.")
            yield out


class ShardStream(EpochStream):
    """An endless, resumable stream of training batches from a :class:`ShardSource`.

    The same interface as :class:`~mmvl.data.loaders.TrainStream`: ``next()``, ``epoch``,
    ``batches_per_epoch`` (the same in every epoch: the plan's batch counts depend on the shard sizes
    only, see :func:`~mmvl.data.shards.plan_epoch`), ``state_dict``/``load_state_dict``."""

    def __init__(self, source: ShardSource, *, batch_size: int, seed: int, rank: int, world_size: int,
                 num_workers: int = 0, pin_memory: bool = False, persistent_workers: bool = False):
        self.source, self.seed, self.rank, self.world_size = source, seed, rank, world_size
        self.batch_size, self.workers = batch_size, max(1, num_workers)
        if len(source.paths) < world_size:
            raise UserError(f"{source.name}: {len(source.paths)} shards cannot feed {world_size} ranks; write at "
                            f"least one shard per rank (ideally ranks x training.num_workers = "
                            f"{world_size * self.workers}).")
        source.configure(seed=seed, rank=rank, world_size=world_size, workers=self.workers, batch_size=batch_size)
        self._generator = torch.Generator()
        self.loader = DataLoader(source, batch_size=None, num_workers=num_workers, pin_memory=pin_memory,
                                 generator=self._generator,
                                 persistent_workers=bool(persistent_workers) and num_workers > 0,
                                 worker_init_fn=freeze_inherited if num_workers else None)
        self.epoch, self.batch = 0, 0
        self._plan = self._plan_of(0)
        self.batches_per_epoch = self._plan.per_rank
        self._iter: Iterator[Any] | None = None

    def _plan_of(self, epoch: int) -> EpochPlan:
        plan = self.source.plan(epoch)
        if plan.per_rank == 0:
            raise UserError(f"{self.source.name}: a rank's shards hold fewer samples than one batch "
                            f"({self.batch_size}) in epoch {epoch}; lower training.batch_size or write more "
                            "samples per shard.")
        return plan

    def _arm(self) -> None:
        self._plan = self._plan_of(self.epoch)
        if self.rank == 0 and self.batch == 0:
            log.info("%s epoch %d: %d batches per rank from %d shards; %d of %d samples dropped (the remainder "
                     "of the split over %d ranks x %d workers x batch %d)", self.source.name, self.epoch,
                     self._plan.per_rank, len(self.source.paths), self._plan.dropped, len(self.source),
                     self.world_size, self.workers, self.batch_size)
        order = self._plan.order()
        rotation = order[self.batch] if self.batch < len(order) else 0
        self.source.control.copy_(torch.tensor([self.epoch, self.batch, rotation]))

    def _layout(self) -> dict[str, int]:
        return {"world_size": self.world_size, "workers": self.workers, "shards": len(self.source.paths),
                "batch_size": self.batch_size}

    def state_dict(self) -> dict[str, int]:
        """The position; each worker's shard, place in it and shuffle buffer follow from it (see
        :mod:`mmvl.data.shards`)."""
        return {"epoch": self.epoch, "batch": self.batch, **self._layout()}

    def load_state_dict(self, state: dict[str, int]) -> None:
        changed = {k: (state[k], v) for k, v in self._layout().items() if k in state and int(state[k]) != v}
        if changed:
            what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
            raise UserError(f"{self.source.name}: the checkpoint's shard position was saved with another layout "
                            f"({what}); resume with the same world size, training.num_workers, shards and "
                            "batch size as the run that saved it.")
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])
        if self.batch > self._plan_of(self.epoch).per_rank:
            raise UserError(f"{self.source.name}: checkpoint data position (batch {self.batch} of epoch "
                            f"{self.epoch}) is past the end of that epoch; the shards changed since.")
        self._iter = None


def train_stream(dataset: Any, *, batch_size: int, collate_fn: Callable, seed: int, rank: int, world_size: int,
                 num_workers: int = 0, pin_memory: bool = False, persistent_workers: bool = False,
                 name: str = "dataset", group_by_length: bool = False) -> Any:
    """The training stream for ``dataset``: a :class:`ShardStream` for shards (which collate in their
    workers), else a :class:`~mmvl.data.loaders.TrainStream` (``group_by_length``: batches of
    samples of similar length)."""
    if isinstance(dataset, ShardSource):
        if group_by_length:
            raise UserError(f"training.group_by_length=true, but dataset {name!r} streams shards, whose order "
                            "each worker draws from its shard; set training.group_by_length=false.")
        return ShardStream(dataset, batch_size=batch_size, seed=seed, rank=rank, world_size=world_size,
                           num_workers=num_workers, pin_memory=pin_memory, persistent_workers=persistent_workers)
    return TrainStream(dataset, batch_size=batch_size, collate_fn=collate_fn, seed=seed, rank=rank,
                       world_size=world_size, num_workers=num_workers, pin_memory=pin_memory,
                       persistent_workers=persistent_workers, name=name, group_by_length=group_by_length)
