"""What ``Engine.prepare`` makes of a user's DataLoader: the same loader, sharded per rank, resumable.

The user's loader is rebuilt with every one of its settings (workers, ``worker_init_fn``,
``persistent_workers``, ``prefetch_factor``, ``timeout``, ``multiprocessing_context``, collate,
pinning, ``drop_last``) around a sharded form of *its own* sampler or batch sampler:

how it is divided between the processes is :mod:`mmvl.engine.shards`' (Accelerate's: one step's
batches over the ranks, concatenated, are the single-process run's batch of W times the size).

The random draws are Accelerate's, so a script ported from it sees the same batches in the same
order for the same seed. Each epoch starts as a plain DataLoader's does: the loader's base seed is
drawn (from its ``generator``, else torch's global RNG), then the sampler's order. In one process a
shuffling sampler without a ``generator`` draws its order from the global RNG, as a plain loader's
``RandomSampler`` does. At several processes ``prepare`` gives such a sampler a ``generator``, seeded
by one draw of the global RNG, and every epoch draws from rank 0's state of it, so the ranks agree
(a sampler without a ``generator`` attribute draws from (seed, epoch) only, the same on every rank).

Resuming: the states those draws started from at the epoch's start (the user generators' and the
global RNG's) are kept in the loader's state, so the state is ``{epoch, batch, seed[, generators,
global_rng]}`` and a resume re-derives the epoch's order from them, without drawing again, and skips
the consumed batches without reading them. Worker seeds come from the loader's own generator
re-seeded per (seed, epoch, rank).
"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from mmvl.data.loaders import worker_seed
from mmvl.distributed import comm
from mmvl.engine.plugins import DataLoaderConfiguration, GradientState
from mmvl.engine.prepared import DeviceLoader
from mmvl.engine.shards import RankBatches, SeedableRandomSampler, ShardedIterable, seedable
from mmvl.errors import UserError

if TYPE_CHECKING:
    from mmvl.engine.clock import StepClock


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
    """The user's loader, sharded for this rank (:mod:`mmvl.engine.shards`), on the device, and
    resumable mid-epoch.

    Each ``iter()`` is one epoch: the next one, or the restored one after ``load_state_dict`` /
    :meth:`skip_to` / :meth:`set_epoch`. ``state_dict()`` is ``{epoch, batch, seed}`` (plus the
    user generators' states from which that epoch's order is drawn, when there are any).
    """

    def __init__(self, engine: "StepClock", loader: DataLoader, seed: int, config: Any = None):
        self.engine, self.user_loader, self.seed = engine, loader, int(seed)
        config = config if config is not None else DataLoaderConfiguration()
        rank, world = engine.rank, engine.world_size
        self._worker_generator = torch.Generator()
        self.batch_size = loader.batch_size
        self.iterable = isinstance(loader.dataset, IterableDataset)
        common = dict(_settings(loader), generator=self._worker_generator)
        split, even = bool(config.split_batches), bool(config.even_batches)
        size = loader.batch_size
        if split and world > 1 and size is not None and size % world:
            raise UserError(f"split_batches=True with batch_size={size} at {world} processes: the batch must "
                            f"divide evenly; use a batch size that is a multiple of {world}.")
        per_rank = size // world if split and size is not None else size
        if self.iterable:
            self.shard: Any = ShardedIterable(loader.dataset, rank, world, per_rank or 1, even)
            built = DataLoader(self.shard, batch_size=per_rank, drop_last=loader.drop_last, **common)
        else:
            sampler_batches = loader.batch_size is None and loader.batch_sampler is None  # sampler= yields lists
            sampler = loader.sampler
            if config.use_seedable_sampler:
                sampler = seedable(sampler, self.seed)
            else:
                _give_a_generator(_sampler_of(loader), world)
            if loader.batch_size is not None:  # batch_size=...: its sampler in batches, as the loader cuts it
                source: Any = BatchSampler(sampler, loader.batch_size, loader.drop_last)
            else:
                source = sampler if sampler_batches else loader.batch_sampler
            self.shard = RankBatches(source, rank, world, split, even, self.seed,
                                     whole_steps=loader.batch_size is not None and loader.drop_last,
                                     global_rng=world == 1)
            if sampler_batches:
                built = DataLoader(loader.dataset, sampler=self.shard, batch_size=None, **common)
            else:
                built = DataLoader(loader.dataset, batch_sampler=self.shard, **common)
        super().__init__(built, engine.device, engine.prefetch)
        self.epoch, self.batch = 0, 0
        self._pending, self._started = False, False
        self._generator_state: tuple[int, list[torch.Tensor]] | None = None  # (epoch, states it draws from)
        self._global_state: tuple[int, torch.Tensor] | None = None  # (epoch, global RNG state at its start)
        #: the batch just yielded is the epoch's last / holds this many real samples over all ranks
        self.end_of_epoch, self.real_in_batch = False, None

    def _generators(self) -> list[torch.Generator]:
        """The user's generators whose draws decide the epoch: the loader's own (a plain DataLoader
        draws its workers' base seed from it at each epoch) and its sampler's."""
        if self.iterable:
            return []
        found: list[torch.Generator] = []
        sampler = self.shard.sampler
        own = None if isinstance(sampler, SeedableRandomSampler) else getattr(sampler, "generator", None)
        for g in (self.user_loader.generator, own):
            if isinstance(g, torch.Generator) and all(g is not f for f in found):
                found.append(g)
        return found

    # -- position ---------------------------------------------------------------
    def skip_to(self, batch: int) -> None:
        """Start this epoch (the one in progress or restored, else the next) at ``batch``."""
        if batch < 0:
            raise UserError(f"skip_first_batches(loader, {batch}): the number of batches must be >= 0.")
        if not self._pending and self._started:
            self.epoch += 1
        self.batch, self._pending, self._started = int(batch), True, False

    def set_epoch(self, epoch: int) -> None:
        """The next ``iter()`` is epoch ``epoch`` from its start (its order is that epoch's)."""
        self.epoch, self.batch, self._pending, self._started = int(epoch), 0, True, False

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"epoch": self.epoch, "batch": self.batch, "seed": self.seed}
        generators = self._generators()
        if generators:
            recorded = self._generator_state
            in_epoch = recorded is not None and recorded[0] == self.epoch and (self._started or self._pending)
            state["generators"] = recorded[1] if in_epoch else [g.get_state() for g in generators]
        recorded_global = self._global_state
        if recorded_global is not None and recorded_global[0] == self.epoch and (self._started or self._pending):
            state["global_rng"] = recorded_global[1]  # between epochs the next one draws afresh
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])
        self.seed = int(state.get("seed", self.seed))
        self.shard.seed = self.seed
        if state.get("generators") is not None:
            self._generator_state = (self.epoch, list(state["generators"]))
        self._global_state = (self.epoch, state["global_rng"]) if state.get("global_rng") is not None else None
        self._pending, self._started = True, False

    def _batches_in_epoch(self) -> int | None:
        return None if self.iterable else self.shard.steps()

    def _start_epoch(self) -> None:
        """The draws that start an epoch, in a plain DataLoader's order: rank 0's generator states
        to every rank, the loader's base seed (from its generator, else the global RNG), then the
        order. A resumed epoch replays them from the states recorded at its start, the global RNG
        left as the checkpoint restored it (after those draws)."""
        recorded = self._global_state
        resumed = self._pending and recorded is not None and recorded[0] == self.epoch
        with torch.random.fork_rng(devices=[]) if resumed else contextlib.nullcontext():
            if resumed:
                torch.set_rng_state(recorded[1])
            else:
                self._global_state = (self.epoch, torch.get_rng_state())
            self._prepare_generators()
            base = self.user_loader.generator
            torch.empty((), dtype=torch.int64).random_(generator=base if isinstance(base, torch.Generator) else None)
            if self.iterable:
                self.shard.skip = self.batch
            else:
                self.shard.set_epoch(self.epoch, start=self.batch)

    def _prepare_generators(self) -> None:
        """Every rank draws this epoch from rank 0's generator states (restored for a resumed epoch)."""
        generators = self._generators()
        if not generators:
            return
        recorded = self._generator_state
        if self._pending and recorded is not None and recorded[0] == self.epoch:
            states = recorded[1]
        else:
            states = [g.get_state() for g in generators]
            if self.engine.world_size > 1:
                states = comm.broadcast_object(states)
            self._generator_state = (self.epoch, states)
        for generator, state in zip(generators, states):
            generator.set_state(state)

    # -- iteration --------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        resumed = self._pending
        if not self._pending:
            if self._started:
                self.epoch += 1
            self.batch = 0
        total = self._batches_in_epoch()
        if total is not None and self.batch > total:
            raise UserError(f"the loader's position (batch {self.batch} of epoch {self.epoch}) is past the end of "
                            f"its epoch ({total} batches); the data or batch size changed since save_state.")
        self._pending = resumed
        self._start_epoch()
        self._pending, self._started = False, True
        self._worker_generator.manual_seed(worker_seed(self.seed, self.epoch, self.engine.rank))
        state = self.engine.gradient_state
        state._add_dataloader(self)
        try:
            yield from (self._iterable_epoch() if self.iterable else self._sized_epoch(total))
            self.epoch, self.batch, self._started = self.epoch + 1, 0, False
        finally:
            state._remove_dataloader(self)
            self.end_of_epoch, self.real_in_batch = False, None

    def _sized_epoch(self, total: int | None) -> Iterator[Any]:
        for batch in DeviceLoader.__iter__(self):
            index = self.batch
            self.batch += 1
            self.end_of_epoch = self.batch == total
            self.real_in_batch = self.shard.real[index] if index < len(self.shard.real) else None
            yield batch

    def _iterable_epoch(self) -> Iterator[Any]:
        """One batch of look-ahead: only the stream's end tells which batch is its last."""
        items = iter(DeviceLoader.__iter__(self))
        current = next(items, _END)
        while current is not _END:
            following = next(items, _END)
            self.batch += 1
            self.end_of_epoch = following is _END
            self.real_in_batch = self.shard.real_in_last_group if self.end_of_epoch else None
            yield current
            current = following

    def __len__(self) -> int:
        if self.iterable:
            raise TypeError("a prepared loader over an IterableDataset has no length")
        return self.shard.steps()


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
        if name.startswith("__") or name == "prepared":  # not set yet (unpickling): no forwarding
            raise AttributeError(name)
        return getattr(self.prepared, name)


_END = object()


def _sampler_of(loader: DataLoader) -> Any:
    """The sampler inside the loader's batch sampler (Accelerate's ``get_sampler``)."""
    if isinstance(loader.sampler, BatchSampler):
        return getattr(loader.sampler, "sampler", None)
    return getattr(loader.batch_sampler, "sampler", None)


def _give_a_generator(sampler: Any, world: int) -> None:
    """At several processes a sampler that can take a ``generator`` and has none gets one, seeded by
    one draw of the global RNG (Accelerate's ``prepare_data_loader``): its draws are then rank 0's."""
    if world > 1 and sampler is not None and hasattr(sampler, "generator") and sampler.generator is None:
        sampler.generator = torch.Generator()
        sampler.generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))


def prepare_data_loader(dataloader: DataLoader, device: Any = None, num_processes: int | None = None,
                        process_index: int | None = None, split_batches: bool = False, put_on_device: bool = False,
                        rng_types: Any = None, dispatch_batches: bool | None = None, even_batches: bool = True,
                        slice_fn_for_dispatch: Any = None, use_seedable_sampler: bool = False,
                        data_seed: int | None = None, non_blocking: bool = False,
                        use_stateful_dataloader: bool = False, torch_device_mesh: Any = None) -> PreparedLoader:
    """Accelerate's function form of ``prepare`` for one loader, without an Engine: this process's
    shard of ``dataloader`` (rank ``process_index`` of ``num_processes``, by default the process
    group's), its batches moved to ``device`` with ``put_on_device``. ``rng_types`` is not needed
    (ranks draw the same order by construction); ``slice_fn_for_dispatch``/``torch_device_mesh``
    are not supported."""
    if slice_fn_for_dispatch is not None or torch_device_mesh is not None:
        raise UserError("prepare_data_loader(slice_fn_for_dispatch=..., torch_device_mesh=...) is not supported "
                        "by mmvl; leave them out.")
    config = DataLoaderConfiguration(split_batches, dispatch_batches, even_batches, use_seedable_sampler, data_seed,
                                     non_blocking, use_stateful_dataloader)
    host = SimpleNamespace(
        rank=comm.get_rank() if process_index is None else int(process_index),
        world_size=comm.get_world_size() if num_processes is None else int(num_processes),
        device=torch.device(device) if put_on_device and device is not None else torch.device("cpu"),
        prefetch=False, gradient_state=GradientState())
    seed = data_seed if data_seed is not None else comm.broadcast_object(torch.initial_seed())
    return PreparedLoader(host, dataloader, seed, config)  # type: ignore[arg-type]


__all__ = ["PreparedLoader", "SkippedLoader", "prepare_data_loader"]
