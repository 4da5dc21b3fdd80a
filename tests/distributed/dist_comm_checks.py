"""Collective checks run on every rank of the shared group (see ``dist_checks.run_all``)."""
from __future__ import annotations

import datetime
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from mmvl.distributed import comm
from mmvl.distributed.init import seed_everything, seed_for_init

N_ODD = 7  # dataset size that does not split evenly over 2 ranks
TIMEOUT_S = 2.0


def _eval_outputs(indices: list[int]) -> dict[str, Any]:
    """What an evaluation loop would collect for these dataset items, batch by batch."""
    scores, ids = [], []
    for start in range(0, len(indices), 2):  # batches of 2
        chunk = indices[start:start + 2]
        scores.append(torch.tensor([[float(i), float(i * i)] for i in chunk]))
        ids.extend(f"q{i}" for i in chunk)
    return {"scores": torch.cat(scores), "ids": ids, "index": torch.tensor(indices)}


def comm_checks(env) -> dict[str, Any]:
    rank, world = env.rank, env.world_size
    out: dict[str, Any] = {"rank": rank, "world": world, "backend": env.backend, "transport": dist.get_backend(),
                           "comm_device": str(comm.communication_device()),
                           "is_main": comm.is_main_process(), "comm_rank": comm.get_rank(),
                           "comm_world": comm.get_world_size()}
    # different first-dimension sizes: rank 0 has 1 row, rank 1 has 3
    rows = 1 if rank == 0 else 3
    out["all_gather"] = comm.all_gather(torch.full((rows, 2), float(rank)))
    out["all_gather_scalar"] = comm.all_gather(torch.tensor(float(rank) + 0.5))
    out["all_gather_empty"] = comm.all_gather(torch.zeros((0 if rank == 0 else 2, 3)))
    out["all_gather_object"] = comm.all_gather_object({"rank": rank})
    tensor = torch.tensor([10.0 * rank + 1])
    out["broadcast_returned_same"] = comm.broadcast(tensor, src=1) is tensor
    out["broadcast"] = tensor
    out["broadcast_object"] = comm.broadcast_object({"sender": rank}, src=1)
    out["reduce_dict"] = comm.reduce_dict({"loss": torch.tensor(float(rank + 1)),
                                           "acc": torch.tensor(2.0 * rank)})
    out["all_reduce_mean"] = comm.all_reduce_mean(torch.tensor([float(rank)]))
    for shuffle in (False, True):
        sampler = DistributedSampler(range(N_ODD), num_replicas=world, rank=rank, shuffle=shuffle, seed=3)
        local = list(sampler)
        out[f"local_{shuffle}"] = local
        out[f"gathered_{shuffle}"] = comm.gather_for_metrics(_eval_outputs(local), N_ODD)
    seed_everything(5, rank)
    out["per_rank_random"] = torch.rand(1)
    seed_for_init(5)
    out["init_random"] = torch.rand(1)
    comm.synchronize()
    # a rank that never arrives: the collective fails at the group's timeout instead of waiting forever
    group = dist.new_group(timeout=datetime.timedelta(seconds=TIMEOUT_S))
    if rank == 0:
        start = time.monotonic()
        try:
            dist.barrier(group=group)
            out["timeout_error"] = None
        except Exception as e:  # noqa: BLE001 - the type depends on the backend
            out["timeout_error"] = type(e).__name__
        out["waited_s"] = time.monotonic() - start
    else:
        time.sleep(3 * TIMEOUT_S)
    shim = getattr(sys.modules.get("comm_shim"), "ACTIVE", None)
    out["shim_checked"] = sorted(set(shim.checked)) if shim is not None else None
    return out
