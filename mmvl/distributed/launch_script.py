"""Start a user's own training script in N processes per machine (``mmvl_launch``, what ``accelerate
launch`` is), under torch's elastic agent as :mod:`mmvl.distributed.launch` starts ``mmvl_run``.

The launch settings (Accelerate's config-file keys: ``num_processes``, ``num_machines``,
``machine_rank``, ``main_process_ip``, ``main_process_port``, ``mixed_precision``,
``gradient_accumulation_steps``, ``distributed_type``, ``compute_environment``) come from a YAML file (``mmvl_launch config`` writes
it) with the command-line flags on top. One machine: a c10d rendezvous on a free local port, as
``torchrun --standalone``. Several: a static rendezvous at ``main_process_ip:main_process_port``
with this machine's rank, as ``torchrun --nnodes N --node_rank R --master_addr A``; no rank is
assumed to be on 127.0.0.1. Each worker is ``python -u <script> <its arguments>`` with the torchrun
variables, plus :data:`MIXED_PRECISION_ENV` and :data:`ACCUMULATION_ENV`, which an Engine made in the
script reads when its own arguments do not name a precision or an accumulation (as Accelerate's
``ACCELERATE_MIXED_PRECISION`` and ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS``).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import uuid
from pathlib import Path
from typing import Any, Mapping

import yaml

from mmvl import io
from mmvl.distributed.launch import worker_environ
from mmvl.errors import UserError, did_you_mean

log = logging.getLogger(__name__)

#: the mixed precision a launched Engine takes when its arguments name none: no | fp16 | bf16
MIXED_PRECISION_ENV = "MMVL_MIXED_PRECISION"
ACCUMULATION_ENV = "MMVL_GRADIENT_ACCUMULATION_STEPS"
#: where ``mmvl_launch config`` writes and ``mmvl_launch`` reads the settings by default
CONFIG_ENV = "MMVL_LAUNCH_CONFIG"
DEFAULT_CONFIG = Path("~/.cache/mmvl/launch.yaml")
MIXED_PRECISIONS = ("no", "fp16", "bf16")
#: distributed_type values mmvl launches (MULTI_CPU hides the GPUs from the workers)
DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU")
COMPUTE_ENVIRONMENTS = ("LOCAL_MACHINE",)
DEFAULT_PORT = 29500
#: keys of Accelerate's config file mmvl reads nothing from (read past with one warning line)
ACCELERATE_ONLY = ("debug", "downcast_bf16", "enable_cpu_affinity", "gpu_ids", "main_training_function",
                   "rdzv_backend", "same_network", "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "use_cpu")


@dataclasses.dataclass
class LaunchSettings:
    """What one ``mmvl_launch`` starts; the field names are the config file's keys."""

    compute_environment: str = "LOCAL_MACHINE"
    distributed_type: str = "MULTI_CPU"
    num_processes: int = 1
    mixed_precision: str = "no"
    gradient_accumulation_steps: int = 1
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: str | None = None
    main_process_port: int | None = None

    def check(self) -> "LaunchSettings":
        """A UserError naming the first setting that cannot be launched."""
        for key, allowed in (("compute_environment", COMPUTE_ENVIRONMENTS), ("distributed_type", DISTRIBUTED_TYPES),
                             ("mixed_precision", MIXED_PRECISIONS)):
            value = getattr(self, key)
            if value not in allowed:
                raise UserError(f"{key}={value!r} is not one of {', '.join(allowed)}.{did_you_mean(str(value), allowed)}")
        for key in ("num_processes", "num_machines", "gradient_accumulation_steps"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise UserError(f"{key}={getattr(self, key)!r} must be a whole number >= 1.")
        if not isinstance(self.machine_rank, int) or not 0 <= self.machine_rank < self.num_machines:
            raise UserError(f"machine_rank={self.machine_rank!r} must be from 0 to num_machines-1 "
                            f"(num_machines={self.num_machines}).")
        if self.num_machines > 1 and not self.main_process_ip:
            raise UserError(f"num_machines={self.num_machines} needs main_process_ip: the address of machine 0, "
                            "which every machine can reach (e.g. --main_process_ip 10.0.0.1).")
        if self.distributed_type == "NO" and self.num_processes * self.num_machines > 1:
            raise UserError(f"distributed_type=NO with {self.num_processes * self.num_machines} processes; "
                            "set distributed_type MULTI_CPU or MULTI_GPU, or num_processes 1.")
        return self


def config_path(path: str | os.PathLike[str] | None) -> Path:
    """``path``, else ``$MMVL_LAUNCH_CONFIG``, else ``~/.cache/mmvl/launch.yaml``."""
    return Path(path or os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG).expanduser()


def read_settings(path: str | os.PathLike[str] | None, overrides: Mapping[str, Any]) -> LaunchSettings:
    """The settings of the file at ``path`` (when given, it must exist; the default file may be
    absent), with the command line's ``overrides`` (values that are not None) on top."""
    file = config_path(path)
    values: dict[str, Any] = {}
    if path is not None and not file.is_file():
        raise UserError(f"--config_file {file}: no such file; write one with `mmvl_launch config --config_file {file}`.")
    if file.is_file():
        loaded = yaml.safe_load(file.read_text(encoding="utf-8")) or {}
        if not isinstance(loaded, dict):
            raise UserError(f"{file} is not a mapping of launch settings; write it with `mmvl_launch config`.")
        known = [f.name for f in dataclasses.fields(LaunchSettings)]
        unknown = [k for k in loaded if k not in known and k not in ACCELERATE_ONLY]
        if unknown:
            raise UserError(f"{file}: unknown launch setting {unknown[0]!r}.{did_you_mean(str(unknown[0]), known)} "
                            f"Settings: {', '.join(known)}.")
        ignored = sorted(k for k in loaded if k in ACCELERATE_ONLY)
        if ignored:
            log.warning("%s: Accelerate settings mmvl does not use, ignored: %s", file, ", ".join(ignored))
        values = {k: v for k, v in loaded.items() if k in known}
    values.update({k: v for k, v in overrides.items() if v is not None})
    return LaunchSettings(**values).check()


def write_settings(settings: LaunchSettings, path: str | os.PathLike[str] | None) -> Path:
    """Write ``settings`` as the YAML config file (atomically); returns its path."""
    file = config_path(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(dataclasses.asdict(settings.check()), sort_keys=False)
    return io.atomic_write(file, "w", lambda out: out.write(text))


def launch_script(settings: LaunchSettings, script: str, args: list[str], max_restarts: int = 0) -> int:
    """Run ``python -u script *args`` in ``settings.num_processes`` workers on this machine (one of
    ``num_machines``); 0 when every worker succeeded, 1 after a failure (torch's summary printed)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if not Path(script).is_file():
        raise UserError(f"mmvl_launch: the script {script!r} does not exist; give the path of your training script.")
    options: dict[str, Any] = dict(
        min_nodes=settings.num_machines, max_nodes=settings.num_machines, nproc_per_node=settings.num_processes,
        max_restarts=max_restarts, start_method="spawn", monitor_interval=0.1)
    if settings.num_machines == 1:
        port = settings.main_process_port or 0
        options.update(run_id=uuid.uuid4().hex, rdzv_backend="c10d", rdzv_endpoint=f"localhost:{port}")
    else:
        port = settings.main_process_port or DEFAULT_PORT
        options.update(run_id="none", rdzv_backend="static", rdzv_endpoint=f"{settings.main_process_ip}:{port}",
                       rdzv_configs={"rank": settings.machine_rank})
    env = {MIXED_PRECISION_ENV: settings.mixed_precision, ACCUMULATION_ENV: str(settings.gradient_accumulation_steps),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if settings.distributed_type == "MULTI_CPU":
        env["CUDA_VISIBLE_DEVICES"] = ""
    log.info("mmvl_launch: %d processes on machine %d of %d (%s, mixed precision %s)", settings.num_processes,
             settings.machine_rank, settings.num_machines, settings.distributed_type, settings.mixed_precision)
    with worker_environ(env):
        try:
            elastic_launch(LaunchConfig(**options), sys.executable)("-u", script, *args)
        except ChildFailedError as e:
            print(e.format_msg(), file=sys.stderr, flush=True)
            return 1
    return 0

