"""Join (or skip) the process group: torchrun, SLURM, an explicit ``init_method``, or one process.

Everything a launcher says is read once here and returned as a
:class:`~mmvl.distributed.env.DistEnv`; nothing else reads rank variables.
"""
from __future__ import annotations

import datetime
import gc
import logging
import os
import sys
from typing import Any, Mapping, NoReturn

import torch
import torch.distributed as dist

from mmvl.config.schema import BACKENDS
from mmvl.distributed import inflight
from mmvl.distributed.env import DistEnv
from mmvl.config.schema import typed_section
from mmvl.distributed.slurm import detect_slurm
from mmvl.errors import UserError
from mmvl.utils.rng import seed_everything

log = logging.getLogger(__name__)

#: ``distributed.backend`` values (validation lists them from here)
NCCL_KNOBS = {"nsocks_perthread": "NCCL_NSOCKS_PERTHREAD", "socket_nthreads": "NCCL_SOCKET_NTHREADS"}
DEFAULT_TIMEOUT_MINUTES = 30.0


def device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def export_nccl_env(distributed: Any) -> dict[str, str]:
    """Export the typed ``distributed`` section's ``nccl.*`` knobs as ``NCCL_*`` variables (only those set)."""
    exported = {}
    for key, var in NCCL_KNOBS.items():
        value = getattr(distributed.nccl, key)
        if value is not None:
            os.environ[var] = exported[var] = str(value)
    return exported


def _wanted_device(training: Any) -> tuple[bool, int | None]:
    """``training.device`` as (use CUDA, explicit index or None); raises on a value we cannot honour."""
    wanted = str(training.device).strip().lower()
    kind, _, index = wanted.partition(":")
    if kind not in ("auto", "cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
        raise UserError(f"training.device={wanted!r} is not one of auto, cpu, cuda, cuda:N.")
    if kind == "cpu":
        return False, None
    if kind == "auto":
        return torch.cuda.is_available(), None
    if not torch.cuda.is_available():
        raise UserError(f"training.device={wanted} but no CUDA device is visible here; use training.device=auto "
                        "(CUDA when present, else CPU) or cpu.")
    if index and int(index) >= device_count():
        raise UserError(f"training.device={wanted} but only {device_count()} CUDA devices are visible.")
    return True, int(index) if index else None


def _backend(distributed: Any, cuda: bool) -> str:
    backend = str(distributed.backend).lower()
    if backend not in BACKENDS:
        raise UserError(f"distributed.backend={backend!r} is not one of {', '.join(BACKENDS)}; use auto.")
    if backend == "auto":
        return "nccl" if cuda else "gloo"
    if backend == "nccl" and not cuda:
        raise UserError("distributed.backend=nccl needs CUDA devices; "
                        "set distributed.backend=gloo (or auto).")
    return backend


#: the flags ``torch.distributed.launch`` appends to a worker's arguments (newer, older spelling)
LOCAL_RANK_FLAGS = ("--local-rank", "--local_rank")


def split_local_rank(argv: list[str]) -> tuple[list[str], int | None]:
    """``argv`` without ``torch.distributed.launch``'s ``--local-rank=N`` / ``--local_rank N`` (either
    spelling, one or two tokens) and the rank it gave (None: not given). Why: that launcher passes
    the flag to every worker, and a command reading ``key=value`` pairs must not take it for a key."""
    rest: list[str] = []
    found: int | None = None
    items = iter(argv)
    for arg in items:
        name, eq, value = arg.partition("=")
        if name not in LOCAL_RANK_FLAGS:
            rest.append(arg)
            continue
        if not eq:
            value = next(items, "")
        if not value.isdigit():
            raise UserError(f"{name}={value!r} is not a local rank; torch.distributed.launch passes "
                            f"{name}=N with N a whole number (0, 1, ...).")
        found = int(value)
    return rest, found


def argv_local_rank() -> int | None:
    """The local rank ``torch.distributed.launch`` put on this process's command line, if any."""
    return split_local_rank(sys.argv[1:])[1]


def detect_launcher(config: Any, env: Mapping[str, str]) -> dict[str, Any] | None:
    """Rank layout from torchrun (or ``torch.distributed.launch``, whose ``--local-rank`` flag stands
    in for ``LOCAL_RANK``), SLURM or ``distributed.init_method``; ``None`` for one process."""
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        local = env.get("LOCAL_RANK")
        return {"source": "torchrun", "rank": int(env["RANK"]), "world_size": world,
                "local_rank": int(local) if local is not None else (argv_local_rank() or 0),
                "local_world_size": int(env.get("LOCAL_WORLD_SIZE", world)), "init_method": "env://"}
    distributed = typed_section(config, "distributed")
    init_method = distributed.init_method
    slurm = detect_slurm(distributed.port, env)
    if slurm is not None:
        return {"source": "SLURM", "rank": slurm.rank, "world_size": slurm.world_size,
                "local_rank": slurm.local_rank, "local_world_size": slurm.local_world_size,
                "init_method": init_method or f"tcp://{slurm.master_addr}:{slurm.master_port}"}
    if init_method:
        world = int(distributed.world_size if distributed.world_size is not None else 1)
        rank = int(distributed.rank)
        if world < 1 or not 0 <= rank < world:
            raise UserError(f"distributed.rank={rank} is outside distributed.world_size={world}; "
                            "give each process a rank from 0 to world_size-1.")
        per_node = max(1, device_count())
        local = int(distributed.local_rank if distributed.local_rank is not None else rank % per_node)
        return {"source": "init_method", "rank": rank, "world_size": world, "local_rank": local,
                "local_world_size": min(per_node, world), "init_method": init_method}
    return None


def check_world_size(distributed: Any, launched: int) -> None:
    """A ``distributed.world_size`` the user set must agree with the launcher.

    Values of 1 or ``device_count()`` (the default) count as unset, since a
    multi-node launcher legitimately starts more processes than one node has GPUs.
    """
    configured = distributed.world_size
    if configured is None or launched <= 1:
        return
    configured = int(configured)
    if configured <= 1 or configured == device_count() or configured == launched:
        return
    raise UserError(f"distributed.world_size={configured} but the launcher started {launched} processes; "
                    f"set distributed.world_size={launched}")


def local_device_index(local_rank: int, source: str) -> int:
    """This process's GPU among those it sees.

    Usually the local rank. Under SLURM with ``--gpus-per-task`` every task sees only its
    own GPUs (numbered from 0), so the index is ``local_rank % device_count()``. Other
    launchers never hide GPUs per process: more local ranks than GPUs is a mistake there.
    """
    count = device_count()
    if local_rank < count:
        return local_rank
    if source == "SLURM" and count > 0:
        return local_rank % count
    raise UserError(f"local rank {local_rank} ({source}) but only {count} CUDA devices are visible; "
                    f"start at most {count} processes per node.")


def init_distributed(config: Any = None, environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read the launcher, join the process group when there is more than one process, pick the device."""
    environ = os.environ if environ is None else environ
    distributed, training = typed_section(config, "distributed"), typed_section(config, "training")
    export_nccl_env(distributed)
    cuda, index = _wanted_device(training)
    layout = detect_launcher(config, environ)
    if layout is None and dist.is_available() and dist.is_initialized():
        layout = {"source": "existing", "rank": dist.get_rank(), "world_size": dist.get_world_size(),
                  "local_rank": int(environ.get("LOCAL_RANK", 0)),
                  "local_world_size": int(environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())),
                  "init_method": None}
    if layout is None or layout["world_size"] <= 1:
        if cuda and index is not None:
            torch.cuda.set_device(index)
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        return DistEnv(device=device)
    check_world_size(distributed, layout["world_size"])
    local_rank = layout["local_rank"]
    if cuda:
        index = local_device_index(local_rank, layout["source"])
        torch.cuda.set_device(index)  # object collectives and barriers use the current device
        device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")
    backend = _backend(distributed, cuda)
    if not dist.is_initialized():
        minutes = float(distributed.timeout_minutes)
        log.info("Joining process group: %s rank %d/%d via %s (%s)", layout["source"], layout["rank"],
                 layout["world_size"], layout["init_method"], backend)
        _join(backend, layout, datetime.timedelta(minutes=minutes))
    else:
        backend = dist.get_backend()
    return DistEnv(rank=layout["rank"], world_size=layout["world_size"], local_rank=local_rank,
                   local_world_size=layout["local_world_size"], device=device, backend=backend)


#: process groups this process has created (a notebook or sweep makes an Engine more than once)
_groups_made = [0]


def _join(backend: str, layout: dict[str, Any], timeout: datetime.timedelta) -> None:
    """Create the default process group; a group after the first takes its keys under a fresh prefix.

    Why: torch names every default group ``0`` again after ``destroy_process_group``, and a
    launcher's store (torchrun's agent store) outlives the group, so a second group's ranks could
    read the first group's stale addresses and fail to connect ("Connection refused") or hang.
    Every rank creates its groups in the same order, so their counts, and prefixes, agree.
    """
    if _groups_made[0] == 0:
        dist.init_process_group(backend=backend, init_method=layout["init_method"], rank=layout["rank"],
                                world_size=layout["world_size"], timeout=timeout)
    else:
        store, rank, world_size = next(dist.rendezvous(layout["init_method"], layout["rank"],
                                                       layout["world_size"], timeout=timeout))
        store.set_timeout(timeout)
        dist.init_process_group(backend=backend, store=dist.PrefixStore(f"mmvl_group_{_groups_made[0]}", store),
                                rank=rank, world_size=world_size, timeout=timeout)
    if dist.is_initialized():
        _groups_made[0] += 1


def seed_for_init(seed: int) -> int:
    """Seed identically on every rank, so model initialisation matches before wrapping."""
    return seed_everything(seed, 0)


def destroy() -> None:
    """Leave the process group (no-op when none), once the backend let go of every tensor mmvl
    handed it (:mod:`mmvl.distributed.inflight`)."""
    if dist.is_available() and dist.is_initialized():
        inflight.settle()
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End this process with exit status ``code``; in a distributed run, without interpreter shutdown.

    Why: gloo runs each collective on a worker thread that releases the collective's tensors
    only after the caller saw it finish. When Python already dropped such a tensor, that release
    takes the GIL, and CPython ends any thread that takes the GIL while the interpreter shuts down
    with ``pthread_exit``; inside the (noexcept) destructor that is ``std::terminate``: SIGABRT,
    "terminate called without an active exception", and a peer still in a collective sees
    "Connection reset by peer". ``destroy_process_group`` does not stop those threads once DDP or
    FSDP hold the backend, so a rank must not shut the interpreter down while they live. On
    success (``code`` 0) the ranks first meet at a barrier, so none leaves while another is still
    in a collective; then the group is destroyed, objects are collected (data-loader workers stop)
    and output is flushed while Python is whole, and ``os._exit`` ends the process.
    """
    if not (dist.is_available() and dist.is_initialized()):
        sys.exit(code)
    try:
        if code == 0:
            dist.barrier()
        inflight.settle()
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - a peer that already failed: leave anyway
        log.warning("leaving the process group failed (%s: %s)", type(e).__name__, e)
    finally:
        gc.collect()
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)
