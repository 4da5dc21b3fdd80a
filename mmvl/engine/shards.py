"""How a prepared DataLoader's epoch is divided between the processes (Accelerate's semantics).

An epoch is a list of *global* batches: the user's batch sampler's, or the user's sampler's order
cut into batches of the loader's ``batch_size``. Without ``split_batches`` process r takes global
batches r, r+W, ... whole, so one step's batches, concatenated in rank order, are W consecutive
global batches: a run at W processes of batch B sees what one process of batch W*B sees, in the
same order. With ``split_batches`` each global batch is cut into W contiguous parts. With
``even_batches`` (and W > 1) the epoch's end is filled from its start, so every process runs as
many steps with full batches; ``real`` records how many samples of each step are real, which
``gather_for_metrics`` keeps. A leaf module: it knows nothing of the Engine.
"""
from __future__ import annotations

import math
from typing import Any, Iterator

import torch
from torch.utils.data import IterableDataset, RandomSampler, Sampler

from mmvl.data.loaders import epoch_seed
from mmvl.errors import UserError


class SeedableRandomSampler(RandomSampler):
    """A random sampler whose epoch ``e`` order is drawn from the seed ``data_seed + e`` (else the
    global torch seed at construction, plus ``e``): the order of any epoch is reproducible from its
    number alone; ``set_epoch`` picks the epoch (each full pass moves to the next)."""

    def __init__(self, *args: Any, data_seed: int | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.initial_seed = int(data_seed) if data_seed is not None else torch.random.initial_seed()
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed(self.initial_seed + self.epoch)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)


def seedable(sampler: Any, seed: int) -> Any:
    """``sampler`` as a :class:`SeedableRandomSampler` from ``seed`` when it is a plain random
    sampler (``use_seedable_sampler``); any other sampler as it is."""
    if type(sampler) is not RandomSampler:
        return sampler
    return SeedableRandomSampler(sampler.data_source, replacement=sampler.replacement,
                                 num_samples=sampler._num_samples, generator=sampler.generator, data_seed=seed)


def draw(source: Any, seed: int, epoch: int, global_rng: bool = False) -> list[Any]:
    """One epoch of ``source`` (a batch sampler), the same on every rank.

    A sampler with a ``set_epoch`` is told the epoch; one with its own ``generator`` draws from it
    as a plain DataLoader would (the caller makes the ranks' generators agree and keeps the state
    for a resume). Without one it draws from torch's global RNG with ``global_rng`` (one process:
    a plain DataLoader's and Accelerate's order; the caller keeps that RNG's state at the epoch's
    start for a resume), else its order is a function of (seed, epoch) only, drawn without
    touching the run's RNG.
    """
    for part in (source, getattr(source, "sampler", None)):
        if callable(getattr(part, "set_epoch", None)):
            part.set_epoch(epoch)
    if global_rng or isinstance(getattr(getattr(source, "sampler", source), "generator", None), torch.Generator):
        return list(iter(source))
    with torch.random.fork_rng(devices=[]):
        # the CPU generator only (what samplers draw from), restored on leaving
        torch.default_generator.manual_seed(epoch_seed(seed, epoch))
        return list(iter(source))


def _cycle(flat: list[Any], count: int, start: int = 0) -> list[Any]:
    """``count`` items of ``flat`` from ``start`` on, going round from its beginning."""
    if not flat:
        return []
    return [flat[(start + i) % len(flat)] for i in range(count)]


def layout(batches: list[list[Any]], batch_size: int | None, rank: int, world: int, split: bool,
           even: bool) -> tuple[list[list[Any]], list[int | None]]:
    """This rank's batches of an epoch of global ``batches``, and per step the number of real
    samples over all ranks (None: every sample is real)."""
    if world == 1:
        return batches, [None] * len(batches)
    flat = [i for b in batches for i in b]
    filled = 0  # items taken from the epoch's start so far
    if split:
        mine, real = [], []
        for b in batches:
            size = batch_size if batch_size is not None else len(b)
            full = list(b)
            if even and (len(full) < size or len(full) % world):
                need = max(size, math.ceil(len(full) / world) * world) - len(full)
                full += _cycle(flat, need, filled)
                filled += need
            part = math.ceil(len(full) / world)
            mine.append(full[rank * part:(rank + 1) * part])
            real.append(len(b) if len(full) > len(b) else None)
        return mine, real
    padded = [list(b) for b in batches]
    real_sizes = [len(b) for b in batches]
    if even and padded:
        size = batch_size if batch_size is not None else len(padded[0])
        if len(padded[-1]) < size:
            need = size - len(padded[-1])
            padded[-1] += _cycle(flat, need, filled)
            filled += need
        while len(padded) % world:
            padded.append(_cycle(flat, size, filled))
            filled += size
            real_sizes.append(0)
    real: list[int | None] = []
    for step in range(math.ceil(len(padded) / world)):
        group = range(step * world, min((step + 1) * world, len(padded)))
        have, total = sum(real_sizes[i] for i in group), sum(len(padded[i]) for i in group)
        real.append(have if have < total else None)
    return padded[rank::world], real


class RankBatches(Sampler[list[Any]]):
    """This rank's batches of the user's batch sampler (a loader made with ``batch_size`` is its
    sampler in a ``BatchSampler``), one epoch at a time (:meth:`set_epoch`), from batch ``start`` on.
    ``batch_sampler`` is the user's (or that ``BatchSampler``), as Accelerate's shard names it."""

    def __init__(self, batch_sampler: Any, rank: int, world: int, split: bool, even: bool, seed: int,
                 whole_steps: bool = False, global_rng: bool = False):
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        if split and world > 1 and self.batch_size is not None and self.batch_size % world:
            raise UserError(f"split_batches=True with batch_size={self.batch_size} at {world} processes: the batch "
                            f"must divide evenly; use a batch size that is a multiple of {world}.")
        self.batch_sampler, self.rank, self.world, self.split = batch_sampler, rank, world, split
        #: fill the epoch's end from its start (read at each epoch: join_uneven_inputs may change it)
        self.even_batches = even
        self.seed, self.whole_steps = seed, whole_steps  # whole_steps: drop_last drops a partial step too
        self.global_rng = global_rng  # a sampler without a generator draws from torch's global RNG
        self.epoch, self.start = 0, 0
        self._batches: list[list[Any]] | None = None
        self.real: list[int | None] = []

    @property
    def sampler(self) -> Any:
        return getattr(self.batch_sampler, "sampler", None)

    def _global(self, batches: list[Any]) -> list[list[Any]]:
        batches = [list(b) for b in batches]
        if self.whole_steps and not self.split and self.world > 1:
            batches = batches[:len(batches) // self.world * self.world]
        return batches

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start
        batches = self._global(draw(self.batch_sampler, self.seed, epoch, self.global_rng))
        self._batches, self.real = layout(batches, self.batch_size, self.rank, self.world, self.split,
                                          self.even_batches)

    def __iter__(self) -> Iterator[list[Any]]:
        if self._batches is None:
            self.set_epoch(self.epoch, self.start)
        return iter(self._batches[self.start:])

    def steps(self) -> int:
        """Batches of this rank in a whole epoch (without drawing one)."""
        if self._batches is not None:
            return len(self._batches)
        global_batches = len(self.batch_sampler)
        if self.whole_steps and not self.split and self.world > 1:
            global_batches = global_batches // self.world * self.world
        if self.split or self.world == 1:
            return global_batches
        if self.even_batches:
            return math.ceil(global_batches / self.world)
        return len(range(self.rank, global_batches, self.world))

    def __len__(self) -> int:
        return max(0, self.steps() - self.start)


class ShardedIterable(IterableDataset):
    """This rank's part of each group of ``per_rank * W`` items of the user's stream (contiguous:
    rank r takes items ``r*per_rank ... (r+1)*per_rank - 1`` of each group); with ``even`` a last
    partial group is filled from the stream's first items (``real_in_last_group`` counts the real)."""

    def __init__(self, dataset: IterableDataset, rank: int, world: int, per_rank: int, even: bool):
        self.dataset, self.rank, self.world, self.per_rank = dataset, rank, world, per_rank
        self.even_batches = even
        self.skip = 0  # whole groups to skip (a resume), consumed without being yielded
        self.real_in_last_group: int | None = None

    def __iter__(self) -> Iterator[Any]:
        size, first, group = self.per_rank * self.world, [], []
        skip, self.real_in_last_group = self.skip, None
        for item in self.dataset:
            if len(first) < size:
                first.append(item)
            group.append(item)
            if len(group) == size:
                if skip:
                    skip -= 1
                else:
                    yield from group[self.rank * self.per_rank:(self.rank + 1) * self.per_rank]
                group = []
        if group and not skip:
            self.real_in_last_group = len(group)
            if self.even_batches and self.world > 1:
                group += _cycle(first, size - len(group))
            yield from group[self.rank * self.per_rank:(self.rank + 1) * self.per_rank]


__all__ = ["RankBatches", "SeedableRandomSampler", "ShardedIterable", "draw", "layout", "seedable"]
