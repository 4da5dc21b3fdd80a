"""Collectives on 2 real gloo ranks (from the shared group), at world size 1, and the launcher itself."""
from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data import DistributedSampler

from dist_contract import plan_results
from dist_comm_checks import N_ODD, TIMEOUT_S, _eval_outputs
from mmvl.distributed import comm


@pytest.fixture(scope="module")
def ranks(dist_group):
    return plan_results(dist_group, "comm")


@pytest.mark.proc
def test_environment(ranks):
    """The group runs under the checking shim: NCCL claimed (each rank on its own GPU), gloo underneath."""
    for r, res in enumerate(ranks):
        assert (res["rank"], res["world"], res["backend"], res["transport"]) == (r, 2, "nccl", "gloo")
        assert res["comm_device"] == f"cuda:{r}"
        # every kind of collective mmvl.distributed.comm issues went through the shim's checks (its
        # object collectives are its own, over all_gather and broadcast)
        assert {"all_gather", "all_reduce", "broadcast", "barrier"} <= set(res["shim_checked"])
        assert (res["comm_rank"], res["comm_world"], res["is_main"]) == (r, 2, r == 0)


@pytest.mark.proc
def test_all_gather_different_sizes(ranks):
    for res in ranks:
        zero, one = res["all_gather"]
        assert torch.equal(zero, torch.zeros(1, 2)) and torch.equal(one, torch.ones(3, 2))
        assert [t.item() for t in res["all_gather_scalar"]] == [0.5, 1.5]
        assert [tuple(t.shape) for t in res["all_gather_empty"]] == [(0, 3), (2, 3)]
        assert res["all_gather_object"] == [{"rank": 0}, {"rank": 1}]


@pytest.mark.proc
def test_broadcast_honours_src(ranks):
    for res in ranks:
        assert res["broadcast_returned_same"]
        assert res["broadcast"].tolist() == [11.0]  # rank 1's value everywhere
        assert res["broadcast_object"] == {"sender": 1}


@pytest.mark.proc
def test_reduce_dict_is_the_mean_on_every_rank(ranks):
    for res in ranks:
        assert {k: v.item() for k, v in res["reduce_dict"].items()} == {"loss": 1.5, "acc": 1.0}
        assert res["all_reduce_mean"].tolist() == [0.5]


@pytest.mark.proc
@pytest.mark.parametrize("shuffle", [False, True])
def test_gather_for_metrics_equals_single_process(ranks, shuffle):
    # the sampler padded the odd set: 8 positions for 7 items
    assert len(ranks[0][f"local_{shuffle}"]) + len(ranks[1][f"local_{shuffle}"]) == N_ODD + 1
    single_order = list(DistributedSampler(range(N_ODD), num_replicas=1, rank=0, shuffle=shuffle, seed=3))
    want = _eval_outputs(single_order)
    for res in ranks:
        got = res[f"gathered_{shuffle}"]
        assert got["ids"] == want["ids"]
        assert torch.equal(got["scores"], want["scores"])
        assert got["index"].tolist() == single_order
    if not shuffle:
        assert single_order == list(range(N_ODD))


@pytest.mark.proc
def test_seeds(ranks):
    assert not torch.equal(ranks[0]["per_rank_random"], ranks[1]["per_rank_random"])
    assert torch.equal(ranks[0]["init_random"], ranks[1]["init_random"])


@pytest.mark.proc
def test_collective_with_a_missing_rank_times_out(ranks):
    assert ranks[0]["timeout_error"] is not None
    assert TIMEOUT_S * 0.9 <= ranks[0]["waited_s"] < TIMEOUT_S + 10


def test_world_size_one_is_a_no_op():
    t = torch.arange(4.0)
    assert comm.all_gather(t)[0] is t
    assert comm.broadcast(t, src=0) is t
    assert comm.reduce_dict({"a": torch.tensor(2.0)})["a"].item() == 2.0
    assert comm.reduce_dict({}) == {}
    got = comm.gather_for_metrics({"x": t, "ids": ["a", "b", "c", "d"]}, 3)
    assert torch.equal(got["x"], t[:3]) and got["ids"] == ["a", "b", "c"]
    assert torch.equal(comm.gather_for_metrics(t, None), t)
    with pytest.raises(TypeError, match="cannot gather"):
        comm.gather_for_metrics({"x": 3}, 1)


def _crash_rank1_while_rank0_hangs(env):
    if env.rank == 1:
        raise ValueError("boom from rank 1")
    time.sleep(600)  # never reaches a collective: only the launcher can end it


@pytest.mark.slow  # starts and kills processes: with the slow tests, which CI runs too
def test_launcher_fails_fast_on_a_crashed_rank(launch):
    from dist_launch import GRACE_S, LaunchError

    start = time.monotonic()
    with pytest.raises(LaunchError, match="boom from rank 1") as info:
        launch(_crash_rank1_while_rank0_hangs, world_size=2, timeout=120)
    assert "ranks [0] were still running and were killed (after another rank failed)" in str(info.value)
    assert time.monotonic() - start < 60 + GRACE_S  # spawn start-up dominates; far below the 120 s timeout
