"""``Accelerator`` members about the processes: who runs, where, in which precision, and running a
block on some processes only. Mixed into the Engine (through :class:`AcceleratorMembers`); they read
its ``env``, ``strategy``, ``precision``, ``gradient_accumulation`` and ``project_dir``.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from mmvl.distributed import comm
from mmvl.engine import nested
from mmvl.engine.accelerate import MIXED_PRECISION, DistributedType
from mmvl.engine.process import AcceleratorState, ProcessIndex
from mmvl.errors import UserError

_NAMES = {v: k for k, v in MIXED_PRECISION.items()}


class ProcessMembers(ProcessIndex):
    """Process queries, precision names, main-process-first blocks and per-process decorators."""

    env: Any
    strategy: Any
    precision: str
    gradient_accumulation: int
    project_dir: str | None = None

    # -- processes ----------------------------------------------------------------
    @property
    def state(self) -> AcceleratorState:
        """The process's state (rank, world size, device, distribution), shared with ``AcceleratorState()``."""
        return AcceleratorState()

    @property
    def distributed_type(self) -> DistributedType:
        """How the run is distributed (as the shared state says, which may be set through ``state``)."""
        shared = AcceleratorState._value_for(self.env, "distributed_type")
        return shared if shared is not None else self._strategy_distributed_type()

    def _strategy_distributed_type(self) -> DistributedType:
        strategy = self.strategy
        if strategy.shards_parameters:
            return DistributedType.FSDP
        several = strategy.replicas_in_one_process or (strategy.needs_process_group and self.env.world_size > 1)
        if not several:
            return DistributedType.NO
        return DistributedType.MULTI_GPU if self.env.device.type == "cuda" else DistributedType.MULTI_CPU

    @property
    def mixed_precision(self) -> str:
        """``no``, ``fp16`` or ``bf16``: Accelerate's name for ``precision``."""
        return _NAMES[self.precision]

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_accumulation

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        if int(steps) < 1:
            raise UserError(f"gradient_accumulation_steps={steps} must be >= 1.")
        self.gradient_accumulation = int(steps)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (e.g. to build a cache), the others after it."""
        with self._first(self.env.rank == 0):
            yield

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        with self._first(self.env.local_rank == 0):
            yield

    @contextlib.contextmanager
    def _first(self, leader: bool) -> Iterator[None]:
        if not leader:
            comm.synchronize()
        yield
        if leader:
            comm.synchronize()

    def on_main_process(self, function: Callable) -> Callable:
        return self.on_process(function, 0)

    def on_local_main_process(self, function: Callable) -> Callable:
        def run(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if self.is_local_main_process else None
        return run

    def on_last_process(self, function: Callable) -> Callable:
        return self.on_process(function, self.env.world_size - 1)

    def on_process(self, function: Callable | None = None, process_index: int | None = None) -> Callable:
        """Decorator: run ``function`` on rank ``process_index`` only (None elsewhere)."""
        if function is None:
            return lambda f: self.on_process(f, process_index)
        if process_index is None:
            raise UserError("on_process(function, process_index): name the rank to run on.")

        def run(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if self.env.rank == process_index else None
        return run

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """This rank's contiguous part of ``inputs`` (a list, tuple, tensor or dict of them)."""
        yield nested.split(inputs, self.env.rank, self.env.world_size, apply_padding)

    def on_local_process(self, function: Callable | None = None, local_process_index: int | None = None) -> Callable:
        """Decorator: run ``function`` on the process of local rank ``local_process_index`` only."""
        if function is None:
            return lambda f: self.on_local_process(f, local_process_index)
        if local_process_index is None:
            raise UserError("on_local_process(function, local_process_index): name the local rank to run on.")

        def run(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if self.env.local_rank == local_process_index else None
        return run

    @property
    def multi_device(self) -> bool:
        """Data parallel over several GPUs (Accelerate's name; on CPUs it is False, as Accelerate's)."""
        return self.env.world_size > 1 and self.distributed_type == DistributedType.MULTI_GPU

    @property
    def logging_dir(self) -> str | None:
        """Where trackers write: ``project_dir`` (mmvl has no separate logging folder setting)."""
        return self.project_dir


__all__ = ["ProcessMembers"]
