"""What ``Engine.prepare`` makes of a user's DataLoader: the same loader, sharded per rank, resumable.

The user's loader is rebuilt with every one of its settings (workers, ``worker_init_fn``,
``persistent_workers``, ``prefetch_factor``, ``timeout``, ``multiprocessing_context``, collate,
pinning, ``drop_last``) around a sharded form of *its own* sampler or batch sampler:

- a sampler (the default ``batch_size=`` loaders): each epoch's global order is the user's
  sampler's, padded to a multiple of the world size, and rank r takes positions r, r+W, ...
  (as ``DistributedSampler``): a global batch at W ranks of B holds what one process's batch
  of W*B holds;
- a ``batch_sampler``: every batch it yields is a global batch, split the same way between ranks;
- an ``IterableDataset``: rank r takes items r, r+W, ... of the stream.

Resuming follows :mod:`mmvl.data.loaders`' design: each epoch's order is a function of (seed,
epoch) only, so the state is ``{epoch, batch, seed}`` and a resume re-derives the order and skips
the consumed batches' indices without reading them. The sampler is drawn with the global torch
RNG forked and seeded per epoch (and the user's ``generator`` re-seeded per epoch from its own
seed), so ranks agree on the order, each epoch is a new one, and the run's RNG is not touched.
Worker seeds come from the loader's own generator re-seeded per (seed, epoch, rank).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from mmvl.data.loaders import epoch_seed, worker_seed
from mmvl.engine.prepared import DeviceLoader
from mmvl.errors import UserError

if TYPE_CHECKING:
    from mmvl.engine.core import Engine


def _pad(items: list[Any], multiple: int) -> list[Any]:
    """``items`` extended by repeating it from the start to a length divisible by ``multiple``."""
    if not items or len(items) % multiple == 0:
        return items
    target = math.ceil(len(items) / multiple) * multiple
    return (items * math.ceil(target / len(items)))[:target]


def _draw(source: Any, seed: int, epoch: int, generator_seed: int | None) -> list[Any]:
    """One epoch of ``source`` (a sampler or batch sampler), the same on every rank for (seed, epoch)."""
    inner = getattr(source, "sampler", source)
    if callable(getattr(source, "set_epoch", None)):
        source.set_epoch(epoch)
    with torch.random.fork_rng(devices=[]):
        # the CPU generator only (what samplers draw from), restored on leaving: torch.manual_seed would
        # also reseed every accelerator's RNG (not restored here) and costs ~0.5 ms an epoch doing it
        torch.default_generator.manual_seed(epoch_seed(seed, epoch))
        generator = getattr(inner, "generator", None)
        if isinstance(generator, torch.Generator) and generator_seed is not None:
            generator.manual_seed(epoch_seed(generator_seed, epoch))
        return list(iter(source))


class ShardedSampler(Sampler[int]):
    """This rank's indices of the user's sampler for one epoch, from position ``start`` on."""

    def __init__(self, sampler: Sampler, rank: int, world_size: int, seed: int, generator_seed: int | None):
        self.sampler, self.rank, self.world_size = sampler, rank, world_size
        self.seed, self.generator_seed = seed, generator_seed
        self.epoch, self.start, self._order = 0, 0, None

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start
        self._order = _pad(_draw(self.sampler, self.seed, epoch, self.generator_seed), self.world_size)

    def per_rank(self) -> int:
        return math.ceil(len(self.sampler) / self.world_size)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[int]:
        if self._order is None:
            self.set_epoch(self.epoch, self.start)
        return iter(self._order[self.rank::self.world_size][self.start:])

    def __len__(self) -> int:
        return max(0, self.per_rank() - self.start)


class ShardedBatchSampler(Sampler[list[int]]):
    """This rank's part of each batch of the user's batch sampler (padded to a multiple of W)."""

    def __init__(self, batch_sampler: Any, rank: int, world_size: int, seed: int, generator_seed: int | None):
        self.batch_sampler, self.rank, self.world_size = batch_sampler, rank, world_size
        self.seed, self.generator_seed = seed, generator_seed
        self.epoch, self.start, self._batches, self.sizes = 0, 0, None, []

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start
        self._batches = _draw(self.batch_sampler, self.seed, epoch, self.generator_seed)
        self.sizes = [len(b) for b in self._batches]

    def __iter__(self) -> Iterator[list[int]]:
        if self._batches is None:
            self.set_epoch(self.epoch, self.start)
        return iter([_pad(list(b), self.world_size)[self.rank::self.world_size]
                     for b in self._batches[self.start:]])

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.start)


class ShardedIterable(IterableDataset):
    """Items r, r+W, ... of the user's stream; a last partial group of W is padded from itself,
    so every rank gets as many items (``real_in_last_group`` counts the real ones)."""

    def __init__(self, dataset: IterableDataset, rank: int, world_size: int):
        self.dataset, self.rank, self.world_size = dataset, rank, world_size
        self.skip = 0  # items of this rank to skip (a resume), consumed without being yielded
        self.real_in_last_group: int | None = None

    def __iter__(self) -> Iterator[Any]:
        group: list[Any] = []
        skip, self.real_in_last_group = self.skip, None
        for item in self.dataset:
            group.append(item)
            if len(group) == self.world_size:
                if skip:
                    skip -= 1
                else:
                    yield group[self.rank]
                group = []
        if group:
            self.real_in_last_group = len(group)
            if not skip:
                yield _pad(group, self.world_size)[self.rank]


def _settings(loader: DataLoader) -> dict[str, Any]:
    """Every DataLoader setting but dataset, sampling and generator, as the user gave them."""
    settings: dict[str, Any] = dict(
        num_workers=loader.num_workers, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
        timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        persistent_workers=loader.persistent_workers, pin_memory_device=loader.pin_memory_device)
    if loader.num_workers > 0:
        settings["prefetch_factor"] = loader.prefetch_factor
    if hasattr(loader, "in_order"):
        settings["in_order"] = loader.in_order
    return settings


class PreparedLoader(DeviceLoader):
    """The user's loader, sharded for this rank, on the device, and resumable mid-epoch.

    Each ``iter()`` is one epoch: the next one, or the restored one after ``load_state_dict`` /
    :meth:`skip_to`. ``state_dict()`` is ``{epoch, batch, seed}``.
    """

    def __init__(self, engine: "Engine", loader: DataLoader, seed: int):
        self.engine, self.user_loader, self.seed = engine, loader, int(seed)
        rank, world = engine.rank, engine.world_size
        gen = loader.generator
        gen_seed = int(gen.initial_seed()) if isinstance(gen, torch.Generator) else None
        self._worker_generator = torch.Generator()
        self.batch_size = loader.batch_size
        self.iterable = isinstance(loader.dataset, IterableDataset)
        common = dict(_settings(loader), generator=self._worker_generator)
        if self.iterable:
            self.shard: Any = ShardedIterable(loader.dataset, rank, world)
            built = DataLoader(self.shard, batch_size=loader.batch_size, drop_last=loader.drop_last, **common)
        elif loader.batch_size is not None:  # DataLoader(batch_size=...): shard its sampler
            self.shard = ShardedSampler(loader.sampler, rank, world, seed, gen_seed)
            built = DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=self.shard,
                               drop_last=loader.drop_last, **common)
        else:  # DataLoader(batch_sampler=...): shard each of its batches
            self.shard = ShardedBatchSampler(loader.batch_sampler, rank, world, seed, gen_seed)
            built = DataLoader(loader.dataset, batch_sampler=self.shard, **common)
        super().__init__(built, engine.device, engine.prefetch)
        self.epoch, self.batch = 0, 0
        self._pending, self._started = False, False
        #: the batch just yielded is the epoch's last / holds this many real samples over all ranks
        self.end_of_epoch, self.real_in_batch = False, None

    # -- position ---------------------------------------------------------------
    def skip_to(self, batch: int) -> None:
        """Start this epoch (the one in progress or restored, else the next) at ``batch``."""
        if batch < 0:
            raise UserError(f"skip_first_batches(loader, {batch}): the number of batches must be >= 0.")
        if not self._pending and self._started:
            self.epoch += 1
        self.batch, self._pending, self._started = int(batch), True, False

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])
        self.seed = int(state.get("seed", self.seed))
        self.shard.seed = self.seed
        self._pending, self._started = True, False

    def _batches_in_epoch(self) -> int | None:
        if self.iterable:
            return None
        if isinstance(self.shard, ShardedBatchSampler):
            return len(self.shard.batch_sampler)
        per_rank = self.shard.per_rank()
        return per_rank // self.batch_size if self.loader.drop_last else math.ceil(per_rank / self.batch_size)

    def _real(self, index: int, total: int | None) -> int | None:
        """How many samples of global batch ``index`` are real (None: all of them)."""
        w = self.engine.world_size
        if isinstance(self.shard, ShardedBatchSampler):
            size = self.shard.sizes[index]
            return size if size % w else None
        if isinstance(self.shard, ShardedSampler) and index == (total or 0) - 1:
            real = len(self.shard.sampler) - index * self.batch_size * w  # type: ignore[arg-type]
            return real if real < self.batch_size * w else None
        return None

    # -- iteration --------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        if not self._pending:
            if self._started:
                self.epoch += 1
            self.batch = 0
        self._pending, self._started = False, True
        total = self._batches_in_epoch()
        if total is not None and self.batch > total:
            raise UserError(f"the loader's position (batch {self.batch} of epoch {self.epoch}) is past the end of "
                            f"its epoch ({total} batches); the data or batch size changed since save_state.")
        if self.iterable:
            self.shard.skip = self.batch * (self.batch_size or 1)
        else:
            self.shard.set_epoch(self.epoch, start=self.batch * (self.batch_size or 1)
                                 if isinstance(self.shard, ShardedSampler) else self.batch)
        self._worker_generator.manual_seed(worker_seed(self.seed, self.epoch, self.engine.rank))
        self.engine.active_loader = self
        yield from (self._iterable_epoch() if self.iterable else self._sized_epoch(total))
        self.epoch, self.batch, self._started = self.epoch + 1, 0, False
        self.end_of_epoch, self.real_in_batch = False, None

    def _sized_epoch(self, total: int | None) -> Iterator[Any]:
        for batch in DeviceLoader.__iter__(self):
            index = self.batch
            self.batch += 1
            self.end_of_epoch = self.batch == total
            self.real_in_batch = self._real(index, total)
            self.engine.active_loader = self
            yield batch

    def _iterable_epoch(self) -> Iterator[Any]:
        """One batch of look-ahead: only the stream's end tells which batch is its last."""
        items = iter(DeviceLoader.__iter__(self))
        current = next(items, _END)
        while current is not _END:
            following = next(items, _END)
            self.batch += 1
            self.end_of_epoch = following is _END
            real = self.shard.real_in_last_group if self.end_of_epoch else None
            w = self.engine.world_size
            self.real_in_batch = None if real is None else (_length(current) - 1) * w + real
            self.engine.active_loader = self
            yield current
            current = following

    def __len__(self) -> int:
        if self.iterable:
            raise TypeError("a prepared loader over an IterableDataset has no length")
        return len(self.loader)


class SkippedLoader:
    """``skip_first_batches``' result: iterating it is the loader's epoch from batch ``n`` on."""

    def __init__(self, loader: PreparedLoader, n: int):
        self.prepared, self.n = loader, n
        loader.skip_to(n)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.prepared)

    def __len__(self) -> int:
        return max(0, (self.prepared._batches_in_epoch() or 0) - self.n)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.prepared, name)


_END = object()


def _length(batch: Any) -> int:
    """Samples in a collated batch: the first tensor's dim 0 (or a list's length)."""
    if isinstance(batch, torch.Tensor):
        return len(batch)
    if isinstance(batch, dict):
        return _length(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)) and batch:
        return _length(batch[0]) if isinstance(batch[0], (torch.Tensor, dict, list, tuple)) else len(batch)
    return 1


__all__ = ["PreparedLoader", "ShardedBatchSampler", "ShardedIterable", "ShardedSampler",
           "SkippedLoader"]
