"""``comm.AsyncMax``: a maximum over the ranks that is started now and read later, without the
starting rank waiting (on CUDA: not even for the device)."""
from __future__ import annotations

import pytest
import torch

from mmvl.distributed import comm
from tests.distributed.dist_launch import launch


def _two_ranks(env) -> list[int]:
    pending = [comm.AsyncMax(env.rank * 5), comm.AsyncMax(0)]
    return [p.result() for p in pending]


@pytest.mark.proc
def test_every_rank_reads_the_maximum():
    assert launch(_two_ranks, world_size=2, timeout=60) == [[5, 0], [5, 0]]


def test_without_a_process_group_it_is_the_value():
    assert comm.AsyncMax(3).result() == 3


@pytest.mark.cuda
def test_nccl_start_does_not_sync_and_result_arrives(tmp_path):
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        torch.cuda.set_sync_debug_mode("error")
        try:
            pending = comm.AsyncMax(7)  # queued on the GPU: starting it never waits
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert pending.result() == 7
    finally:
        dist.destroy_process_group()
