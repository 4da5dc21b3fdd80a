"""Run a function in N real processes (gloo on 127.0.0.1), the way torchrun would start them.

``launch(fn, world_size=2)`` spawns fresh interpreters, sets the torchrun
variables, joins the process group through ``mmvl.distributed.init_distributed``
and calls ``fn(env, *args)`` on every rank. With ``claim="nccl"`` each rank runs
under the checking shim (``comm_shim``): it joins as a GPU job would (NCCL, its
own GPU) over a gloo transport, and every collective is held to NCCL's device
rules; ``env.device`` is the CPU, where the tests' models live. With
``join=False`` the rank joins nothing and ``fn`` gets the shim (or None) instead
of an env, to join by itself (as the Engine does). Each rank's return value (tensors,
numbers, lists, dicts) comes back in rank order. A rank that raises fails the
call with its traceback; a rank that hangs is killed at ``timeout`` seconds,
and the others are killed shortly after the first one fails, so nothing waits
for a dead peer.
"""
from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import shutil
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

GRACE_S = 5.0  # how long the surviving ranks get after one rank failed


class LaunchError(RuntimeError):
    """A rank failed, crashed or timed out."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load(path: str, qualname: str) -> Callable:
    sys.path.insert(0, str(Path(path).parent))
    name = f"_mmvl_dist_target_{Path(path).stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _entry(path: str, qualname: str, rank: int, world_size: int, port: int, outdir: str,
           args: tuple, pg_timeout_s: float, claim: str | None = None, join: bool = True) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        from mmvl.distributed.init import exit_process, init_distributed

        shim = None
        if claim is not None:
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import comm_shim

            shim = comm_shim.claim(claim)
        fn = _load(path, qualname)
        if not join:
            env = shim
        elif shim is not None:
            env = comm_shim.join(shim, {"distributed": {"timeout_minutes": pg_timeout_s / 60}})
        else:
            env = init_distributed({"distributed": {"backend": "gloo", "timeout_minutes": pg_timeout_s / 60},
                                    "training": {"device": "cpu"}})
        result = fn(env, *args)
        torch.save(result, os.path.join(outdir, f"result_{rank}.pt"))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        Path(outdir, f"error_{rank}.txt").write_text(traceback.format_exc())
        sys.stdout.flush()
        os._exit(1)  # do not wait on a process group a peer may have abandoned
    exit_process(0)  # as mmvl's commands end: no interpreter shutdown beside gloo's threads


def launch(fn: Callable, world_size: int = 2, args: tuple = (), timeout: float = 120.0,
           pg_timeout_s: float = 60.0, claim: str | None = None, join: bool = True) -> list[Any]:
    """Run ``fn(env, *args)`` on ``world_size`` ranks; return each rank's result, in rank order.

    ``claim``: run every rank under the checking shim claiming this backend (``"nccl"``).

    ``fn`` must be a module-level function in an importable file (it is
    loaded by path in the children).
    """
    path = os.path.abspath(sys.modules[fn.__module__].__file__)
    outdir = tempfile.mkdtemp(prefix="mmvl_dist_")
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_entry, daemon=True,
                         args=(path, fn.__qualname__, rank, world_size, port, outdir, args, pg_timeout_s,
                               claim, join))
             for rank in range(world_size)]
    try:
        for p in procs:
            p.start()
        deadline, first_failure = time.monotonic() + timeout, None
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if first_failure is None and any(p.exitcode not in (None, 0) for p in procs):
                first_failure = now
            if now > deadline or (first_failure is not None and now - first_failure > GRACE_S):
                break
            time.sleep(0.05)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        errors = [Path(outdir, f"error_{r}.txt") for r in range(world_size)]
        messages = [f"rank {r}:\n{e.read_text()}" for r, e in enumerate(errors) if e.exists()]
        crashed = [r for r, p in enumerate(procs)
                   if r not in hung and p.exitcode != 0 and not errors[r].exists()]
        if messages or crashed or hung:
            detail = "\n".join(messages)
            if crashed:
                detail += f"\nranks {crashed} died without a Python error (exit codes " \
                          f"{[procs[r].exitcode for r in crashed]})"
            if hung:
                detail += f"\nranks {hung} were still running and were killed " \
                          f"({'timeout' if first_failure is None else 'after another rank failed'})"
            raise LaunchError(f"distributed run of {fn.__qualname__} failed:\n{detail}")
        return [torch.load(os.path.join(outdir, f"result_{r}.pt"), weights_only=True)
                for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        shutil.rmtree(outdir, ignore_errors=True)
