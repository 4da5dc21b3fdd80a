"""A checking shim: collectives held to NCCL's device rules while the transport is gloo on the CPU.

A rank under ``claim("nccl")`` behaves, for every collective that mmvl (or a test) issues, as
if it ran NCCL on its own GPU ``cuda:<local_rank>``, and fails with :class:`DeviceMisuse`

- when a collective receives a tensor the claimed backend could not take (a CPU tensor under
  NCCL, e.g. a flag built with ``torch.tensor(...)`` and all-reduced as it is), and
- when a rank's collectives would use another rank's GPU: a tensor on ``cuda:k`` for k other
  than its local rank, or an object collective or barrier while another GPU is current (under
  NCCL torch runs those on ``torch.cuda.current_device()``, which is GPU 0 until the process
  calls ``torch.cuda.set_device``).

How a GPU tensor exists on a CPU host: mmvl moves every tensor a collective needs through one
seam, ``mmvl.distributed.comm.place``, to the device its policy
(``comm.communication_device()``) names. The shim swaps only the physical part of that seam:
moving to ``cuda:k`` keeps the data on the CPU and labels the tensor as ``cuda:k`` (a Tensor
subclass per GPU; the label survives torch ops such as ``zeros_like``, ``cat`` and views, as a
device does), and moving back strips the label. The policy itself is mmvl's, unchanged: it reads
the backend (the claimed one; ``comm.backend`` reports it) and the current GPU, which the shim
simulates per process (``torch.cuda.set_device`` / ``current_device``). ``init_process_group``
is given the claimed backend by mmvl and opened with gloo.

Calls made by torch's and fairscale's own code (DDP, FSDP, ZeRO internals, the inner steps of
an object collective) are trusted and not checked: they run on the model's device, which the
strategies put on the rank's GPU (the device choice itself is what these checks and the
``FakeGPUs`` tests cover).
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

TENSOR_COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
                      "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "all_to_all",
                      "all_to_all_single", "send", "recv", "isend", "irecv")
#: torch runs these on ``torch.cuda.current_device()`` under NCCL
DEVICE_COLLECTIVES = ("barrier", "all_gather_object", "broadcast_object_list", "gather_object",
                      "scatter_object_list", "send_object_list", "recv_object_list")
TRUSTED = ("torch.", "fairscale")


class DeviceMisuse(RuntimeError):
    """A collective that the claimed backend would reject, or that would run on another rank's GPU."""


class OnGPU(torch.Tensor):
    """CPU data standing in for a tensor on GPU ``gpu`` (one subclass per GPU: see :func:`on_gpu`)."""

    gpu: int = -1


@functools.lru_cache(maxsize=None)
def _label(index: int) -> type:
    return type(f"OnCuda{index}", (OnGPU,), {"gpu": index})


def on_gpu(tensor: torch.Tensor, index: int) -> torch.Tensor:
    """``tensor``'s data, labelled as living on ``cuda:index``."""
    return plain(tensor).as_subclass(_label(index))


def plain(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.as_subclass(torch.Tensor) if isinstance(tensor, OnGPU) else tensor


def device_of(tensor: torch.Tensor) -> torch.device:
    """The device a tensor stands for: its label, else where it really is."""
    return torch.device("cuda", tensor.gpu) if isinstance(tensor, OnGPU) else tensor.device


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


class Claim:
    """One process's claimed backend and GPU, and the checks its collectives go through."""

    def __init__(self, backend: str, local_rank: int):
        self.backend, self.local_rank = backend, local_rank
        self.current = 0  # a fresh process's current GPU
        self.checked: list[str] = []  # the collectives checked so far (for tests)

    @property
    def expected(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")

    # -- the checks ------------------------------------------------------------------------------
    def check_tensors(self, name: str, args: tuple, kwargs: dict) -> None:
        self.checked.append(name)
        for t in (*_tensors(args), *_tensors(list(kwargs.values()))):
            where = device_of(t)
            if self.backend == "nccl" and where.type != "cuda":
                raise DeviceMisuse(f"{name} got a tensor on {where} under nccl, which takes CUDA tensors only; "
                                   f"rank with local rank {self.local_rank} should use {self.expected} "
                                   "(move it with mmvl.distributed.comm, or build it there)")
            if where != self.expected:
                raise DeviceMisuse(f"{name} got a tensor on {where} but this rank's collectives belong on "
                                   f"{self.expected} (local rank {self.local_rank})")

    def check_current(self, name: str) -> None:
        self.checked.append(name)
        if self.backend == "nccl" and self.current != self.local_rank:
            raise DeviceMisuse(f"{name} runs on cuda:{self.current} (the current GPU) under nccl, but this rank's "
                               f"GPU is cuda:{self.local_rank}; call torch.cuda.set_device({self.local_rank}) "
                               "before the first collective")

    # -- what the shim puts in place -------------------------------------------------------------
    def place(self, tensor: torch.Tensor, device: torch.device | str, copy: bool = False) -> torch.Tensor:
        """``comm.place``: to ``cuda:k`` as a labelled CPU tensor, anywhere else as a plain one."""
        device = torch.device(device)
        data = plain(tensor)
        data = data.clone() if copy or (isinstance(tensor, OnGPU) and device.type != "cuda") else data
        if device.type == "cuda":
            return on_gpu(data, device.index if device.index is not None else self.current)
        return data

    def _set_device(self, device: Any) -> None:
        self.current = device if isinstance(device, int) else torch.device(device).index

    def _wrap(self, name: str, original: Callable, takes_tensors: bool) -> Callable:
        @functools.wraps(original)
        def collective(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if not caller.startswith(TRUSTED):
                if takes_tensors:
                    self.check_tensors(name, args, kwargs)
                else:
                    self.check_current(name)
            return original(*args, **kwargs)

        return collective

    def install(self, setattr_: Callable[[Any, str, Any], None] = setattr) -> "Claim":
        """Patch torch.distributed, torch.cuda's current device and mmvl's comm seam for this process."""
        from mmvl.distributed import comm

        for name in TENSOR_COLLECTIVES:
            setattr_(dist, name, self._wrap(name, getattr(dist, name), takes_tensors=True))
        for name in DEVICE_COLLECTIVES:
            setattr_(dist, name, self._wrap(name, getattr(dist, name), takes_tensors=False))
        init = dist.init_process_group

        def init_process_group(backend: str | None = None, *args: Any, **kwargs: Any) -> None:
            return init("gloo", *args, **kwargs)  # the transport; the caller asked for self.backend

        setattr_(dist, "init_process_group", init_process_group)
        setattr_(comm, "backend", lambda: self.backend if comm.is_initialized() else None)
        setattr_(comm, "place", self.place)
        setattr_(torch.cuda, "set_device", self._set_device)
        setattr_(torch.cuda, "current_device", lambda: self.current)
        return self

    @contextlib.contextmanager
    def gpus_visible(self, count: int) -> Iterator[None]:
        """While a launcher is read: ``count`` GPUs are visible, so mmvl picks CUDA and NCCL."""
        saved = torch.cuda.is_available, torch.cuda.device_count
        torch.cuda.is_available, torch.cuda.device_count = (lambda: True), (lambda: count)
        try:
            yield
        finally:
            torch.cuda.is_available, torch.cuda.device_count = saved


#: the shim installed in this process, if any
ACTIVE: Claim | None = None


def claim(backend: str) -> Claim:
    """Install the shim in this (spawned) rank, claiming ``backend`` on GPU ``LOCAL_RANK``."""
    global ACTIVE
    ACTIVE = Claim(backend, int(os.environ.get("LOCAL_RANK", 0))).install()
    return ACTIVE


def join(shim: Claim, config: dict[str, Any]):
    """``init_distributed`` as a GPU job would run it (it picks CUDA, NCCL, and sets the device), then
    the same env with the CPU as its physical device, where the models of the tests live."""
    import dataclasses

    from mmvl.distributed.init import init_distributed

    with shim.gpus_visible(int(os.environ.get("LOCAL_WORLD_SIZE", 1))):
        env = init_distributed(config)
    assert env.device == shim.expected and env.backend == shim.backend, (env, shim.expected)
    return dataclasses.replace(env, device=torch.device("cpu"))
