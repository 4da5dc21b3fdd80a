"""``AcceleratorState``: this process's place in the run, shared by every object that asks.

Accelerate keeps one state per process, set up by the first ``Accelerator``; scripts read it
anywhere with ``AcceleratorState()`` (rank, world size, device, how the run is distributed). mmvl's
Engine records the same facts here when it is made (a leaf: this module imports no Engine module;
the Engine hands it its env). Every instance shares one dict, so a value set through one (as
Accelerate's tests do with ``state.distributed_type``) is seen through all, the Engine included.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from mmvl.distributed import comm
from mmvl.engine import nested

_SHARED: dict[str, Any] = {}


class ProcessIndex:
    """The members about a process's place that ``Accelerator`` and ``AcceleratorState`` both have,
    read from the ``env`` (a :class:`~mmvl.distributed.env.DistEnv`) of the class it is mixed into."""

    env: Any

    @property
    def num_processes(self) -> int:
        return self.env.world_size

    @property
    def process_index(self) -> int:
        return self.env.rank

    @property
    def local_process_index(self) -> int:
        return self.env.local_rank

    @property
    def is_local_main_process(self) -> bool:
        return self.env.local_rank == 0

    @property
    def is_last_process(self) -> bool:
        return self.env.rank == self.env.world_size - 1

    @property
    def use_distributed(self) -> bool:
        return self.env.world_size > 1


class AcceleratorState(ProcessIndex):
    """The process's rank, world size, device and distribution, as the latest Engine set them up."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.__dict__ = _SHARED
        if "env" not in _SHARED:
            raise ValueError("AcceleratorState() before any Accelerator: make one first, "
                             "accelerator = Accelerator(), then read the state.")

    @classmethod
    def _set(cls, env: Any, distributed_type: Any, mixed_precision: str) -> Any:
        """Record a new Engine's facts; returns the state's generation (kept until a reset)."""
        generation = _SHARED.get("generation") or object()
        _SHARED.update(env=env, distributed_type=distributed_type, mixed_precision=mixed_precision,
                       generation=generation)
        return generation

    @staticmethod
    def _value_for(env: Any, key: str) -> Any:
        """The shared ``key`` when the state is ``env``'s, else None."""
        return _SHARED.get(key) if _SHARED.get("env") is env else None

    @classmethod
    def _reset_state(cls, reset_partial_state: bool = False) -> None:
        """Forget the state: ``AcceleratorState()`` needs a new Accelerator, and an Engine made
        before the reset refuses to prepare (its state is gone)."""
        _SHARED.clear()

    @staticmethod
    def _check(generation: Any) -> None:
        """Raise when the state an Engine was made with (its ``generation``) was reset since."""
        if _SHARED.get("generation") is not generation:
            raise AttributeError("`AcceleratorState` object has no attribute `env`: the process state this "
                                 "Accelerator was made with is gone. This happens if `AcceleratorState._reset_state()` "
                                 "was called after the Accelerator was made; make a new Accelerator after it.")

    @property
    def initialized(self) -> bool:
        return "env" in _SHARED

    @property
    def device(self) -> Any:
        return self.env.device

    @property
    def is_main_process(self) -> bool:
        return self.env.rank == 0

    def wait_for_everyone(self) -> None:
        comm.synchronize()

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """This rank's contiguous part of ``inputs`` (a list, tuple, tensor or dict of them)."""
        yield nested.split(inputs, self.env.rank, self.env.world_size, apply_padding)

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_local_main_process:
            print(*args, **kwargs)

    def destroy_process_group(self) -> None:
        """Every rank meets, then leaves the process group."""
        from mmvl.distributed.init import destroy

        if comm.is_initialized():
            comm.synchronize()
        destroy()

    def __repr__(self) -> str:
        return (f"Distributed environment: {getattr(self.distributed_type, 'value', self.distributed_type)}\n"
                f"Num processes: {self.num_processes}\nProcess index: {self.process_index}\n"
                f"Local process index: {self.local_process_index}\nDevice: {self.device}\n"
                f"Mixed precision type: {self.mixed_precision}\n")


__all__ = ["AcceleratorState"]
