"""Start ``distributed.world_size`` local processes when a command runs without a launcher.

MMF users write ``mmvl_run config=... distributed.world_size=8`` and expect eight processes.
When no launcher is in sight (no torchrun variables, no multi-task SLURM step, no
``distributed.init_method``), :func:`launch_local` hands the run to torch's elastic agent
(``torch.distributed.launcher.api.elastic_launch``), the agent behind
``torchrun --standalone --nproc-per-node=N``: a c10d rendezvous on a free local port, the
torchrun variables in every worker, ``distributed.max_restarts`` restarts of the whole group
after a failure, and each worker a fresh ``python -u -m <the command's module> <the same
options>`` that finds those variables and joins the group. So the results, the restarts and
the checkpoints are those of the same command under torchrun.

Errors: a :class:`~mmvl.errors.UserError` in a worker is written to a file the launcher
reads, so the command still ends with one line and exit code 2; any other failure shows each
rank's own traceback (the workers share this process's stderr), then torch's summary of the
failed ranks, and exit code 1.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterator, Mapping

from mmvl.distributed.init import detect_launcher, device_count
from mmvl.config.schema import typed_section
from mmvl.errors import UserError

log = logging.getLogger(__name__)

#: where a worker started by :func:`launch_local` writes its UserError for the launcher
USER_ERROR_DIR = "MMVL_USER_ERROR_DIR"
#: signals the agent passes on to the workers before stopping them: torchrun's, plus SLURM's
#: time-limit warning, so a worker can checkpoint (see callbacks/preemption.py)
SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def processes_to_start(config: Any, environ: Mapping[str, str] | None = None) -> int:
    """How many local processes this command must start: ``distributed.world_size`` when it is
    above 1 and no launcher started this process; 0 when this process is the run."""
    import torch.distributed as dist

    environ = os.environ if environ is None else environ
    if detect_launcher(config, environ) is not None or (dist.is_available() and dist.is_initialized()):
        return 0
    world = typed_section(config, "distributed").world_size
    world = int(world if world is not None else 1)
    return world if world > 1 else 0


def _check(config: Any, nproc: int) -> int:
    """``distributed.max_restarts``, after checking that this machine can hold ``nproc`` workers."""
    restarts = int(typed_section(config, "distributed").max_restarts)
    if restarts < 0:
        raise UserError(f"distributed.max_restarts={restarts} must be 0 or more.")
    device = str(typed_section(config, "training").device).lower()
    gpus = device_count()
    if device != "cpu" and gpus and nproc > gpus:
        raise UserError(f"distributed.world_size={nproc} but this machine has {gpus} CUDA devices; without "
                        f"torchrun or SLURM mmvl starts processes on this machine only. Set "
                        f"distributed.world_size<={gpus}, or start the other nodes with torchrun or srun.")
    return restarts


def launch_local(config: Any, module: str, opts: list[str]) -> int:
    """Run ``python -m <module> <opts>`` in ``distributed.world_size`` local workers under torch's
    elastic agent; returns the exit code (0, 1 after a failure) or raises a worker's UserError."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    nproc = processes_to_start(config)
    restarts = _check(config, nproc)
    port = int(typed_section(config, "distributed").port)
    options: dict[str, Any] = dict(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex, rdzv_backend="c10d",
        rdzv_endpoint=f"localhost:{port if port > 0 else 0}", max_restarts=restarts, start_method="spawn",
        monitor_interval=0.1)  # torchrun's default; LaunchConfig's own differs in older torch
    if "signals_to_handle" in {f.name for f in dataclasses.fields(LaunchConfig)}:  # newer torch only
        options["signals_to_handle"] = SIGNALS
    log.info("starting %d local processes (distributed.world_size, no launcher found)", nproc)
    with tempfile.TemporaryDirectory(prefix="mmvl_launch_") as errors, \
            worker_environ({USER_ERROR_DIR: errors, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}), \
            _quiet_after_user_error(Path(errors)):
        try:
            elastic_launch(LaunchConfig(**options), sys.executable)("-u", "-m", module, *opts)
        except ChildFailedError as e:
            messages = sorted(Path(errors).glob("rank_*.txt"), key=lambda p: int(p.stem[5:]))
            if messages:
                raise UserError(_one_line(messages)) from None
            print(e.format_msg(), file=sys.stderr, flush=True)
            return 1
        except SignalException as e:
            print(f"mmvl: stopped by {signal.Signals(e.sigval).name}", file=sys.stderr, flush=True)
            return 128 + int(e.sigval)
    return 0


def _one_line(files: list[Path]) -> str:
    """The workers' UserErrors: one message when all ranks agree, else each rank's."""
    texts = {int(p.stem[5:]): p.read_text(encoding="utf-8").strip() for p in files}
    if len(set(texts.values())) == 1:
        return next(iter(texts.values()))
    return " | ".join(f"rank {rank}: {text}" for rank, text in texts.items())


@contextlib.contextmanager
def _quiet_after_user_error(errors: Path) -> Iterator[None]:
    """Once a worker reported a UserError, the agent's lines about stopping the workers are noise
    around the one line the user needs; other failures keep them (as under torchrun)."""
    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")

    def keep(record: logging.LogRecord) -> bool:
        return not any(errors.iterdir())

    agent_log.addFilter(keep)
    try:
        yield
    finally:
        agent_log.removeFilter(keep)


@contextlib.contextmanager
def worker_environ(values: dict[str, str]) -> Iterator[None]:
    """Set variables the agent passes to its workers (``mmvl_run``'s and ``mmvl_launch``'s); restore
    this process's afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def report_user_error(message: str) -> bool:
    """In a worker of :func:`launch_local`: hand ``message`` to the launcher (which prints it once
    for all ranks) and return True; elsewhere return False (the caller prints it)."""
    folder = os.environ.get(USER_ERROR_DIR)
    if not folder or not os.path.isdir(folder):
        return False
    Path(folder, f"rank_{os.environ.get('RANK', '0')}.txt").write_text(message, encoding="utf-8")
    return True
