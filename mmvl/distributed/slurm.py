"""Read a SLURM job's layout from its environment, without calling ``scontrol``.

``scontrol`` is often missing inside containers, so host lists such as
``node[01-03,07],gpu5`` are expanded here.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping

from mmvl.errors import UserError

DEFAULT_PORT_BASE = 15000  # default master port is base + job id % 20000


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside ``[...]``."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise UserError(f"Malformed SLURM node list {text!r}: unmatched ']'.")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise UserError(f"Malformed SLURM node list {text!r}: unmatched '['.")
    parts.append(text[start:])
    return [p for p in (s.strip() for s in parts) if p]


def _expand_range(spec: str, whole: str) -> list[str]:
    """``01-03,07`` -> ``['01', '02', '03', '07']`` (zero padding kept)."""
    out: list[str] = []
    for item in spec.split(","):
        item = item.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not m:
            raise UserError(f"Malformed SLURM node list {whole!r}: bad range {item!r}.")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise UserError(f"Malformed SLURM node list {whole!r}: range {item!r} runs backwards.")
        width = len(lo)
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def _expand_one(pattern: str, whole: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", pattern)
    if not m:
        return [pattern]
    head, tail = pattern[: m.start()], pattern[m.end():]
    return [head + mid + rest
            for mid in _expand_range(m.group(1), whole)
            for rest in _expand_one(tail, whole)]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM host list (``node[01-03,07],gpu5``) into host names, in order."""
    return [host for part in _split_top_level(nodelist) for host in _expand_one(part, nodelist)]


def _tasks_per_node(value: str, node_id: int) -> int:
    """Parse ``SLURM_NTASKS_PER_NODE``/``SLURM_TASKS_PER_NODE`` (``4``, ``4(x2)``, ``2(x3),1``)."""
    counts: list[int] = []
    for item in value.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not m:
            raise UserError(f"Cannot read SLURM tasks per node {value!r}; expected e.g. '4' or '4(x2)'.")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts[min(node_id, len(counts) - 1)]


@dataclass
class SlurmLayout:
    """Where this task sits in a SLURM step."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    hosts: list[str]


def _int_env(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except KeyError:
        raise UserError(f"SLURM job with several tasks but {key} is not set; "
                        "start the tasks with srun.") from None
    except ValueError:
        raise UserError(f"{key}={env[key]!r} is not an integer.") from None


def slurm_world_size(env: Mapping[str, str] | None = None) -> int:
    """``SLURM_NTASKS`` (1 when not inside SLURM)."""
    env = os.environ if env is None else env
    value = env.get("SLURM_NTASKS", "1")
    return int(value) if value.isdigit() else 1


def detect_slurm(port: int | None = None, env: Mapping[str, str] | None = None) -> SlurmLayout | None:
    """The layout of a multi-task SLURM step, or ``None`` outside SLURM / for one task.

    The master is the first host of the step's node list; the port is ``port``
    when positive, else ``MASTER_PORT``, else derived from the job id so that
    two jobs sharing a node do not collide.
    """
    env = os.environ if env is None else env
    world_size = slurm_world_size(env)
    if world_size <= 1:
        return None
    rank = _int_env(env, "SLURM_PROCID")
    local_rank = _int_env(env, "SLURM_LOCALID")
    node_id = int(env.get("SLURM_NODEID", "0") or 0)
    per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or str(world_size)
    local_world_size = _tasks_per_node(per_node, node_id)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise UserError("SLURM job with several tasks but SLURM_JOB_NODELIST is not set; "
                        "start the tasks with srun.")
    hosts = expand_nodelist(nodelist)
    if not hosts:
        raise UserError(f"SLURM node list {nodelist!r} names no host.")
    addr = env.get("MASTER_ADDR") or hosts[0]
    if port is not None and int(port) > 0:
        master_port = int(port)
    elif env.get("MASTER_PORT", "").isdigit():
        master_port = int(env["MASTER_PORT"])
    else:
        job = env.get("SLURM_JOB_ID", "0")
        master_port = DEFAULT_PORT_BASE + (int(job) % 20000 if job.isdigit() else 0)
    return SlurmLayout(rank, world_size, local_rank, local_world_size, addr, master_port, hosts)
