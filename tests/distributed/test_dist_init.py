"""Launcher detection, world-size checks, NCCL knobs and seeding, with simulated environments."""
from __future__ import annotations

import datetime
import random

import pytest
import torch
import torch.distributed as dist

from mmvl.distributed.init import (destroy, detect_launcher, init_distributed, seed_everything,
                                   seed_for_init)
from mmvl.errors import UserError
from tests.fixtures.fake_cuda import FakeGPUs

LAUNCHER_VARS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE",
                 "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST", "SLURM_JOB_ID",
                 "NCCL_NSOCKS_PERTHREAD", "NCCL_SOCKET_NTHREADS"]


@pytest.fixture
def clean_env(monkeypatch):
    for var in LAUNCHER_VARS:
        monkeypatch.setenv(var, "-")  # records the original value, so teardown restores it
        monkeypatch.delenv(var)
    return monkeypatch


@pytest.fixture
def fake_init(clean_env):
    """Record init_process_group's arguments instead of joining a group."""
    calls = []
    clean_env.setattr(dist, "init_process_group", lambda **kw: calls.append(kw))
    clean_env.setattr(dist, "is_initialized", lambda: False)
    return calls


def test_single_process_joins_no_group(fake_init):
    env = init_distributed({})
    assert (env.rank, env.world_size, env.backend, env.device.type) == (0, 1, None, "cpu")
    assert fake_init == []


def test_torchrun_environment(fake_init):
    fake_init_env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    env = init_distributed({"distributed": {"timeout_minutes": 7}}, environ=fake_init_env)
    assert (env.rank, env.world_size, env.local_rank, env.backend) == (1, 2, 1, "gloo")
    (call,) = fake_init
    assert call["init_method"] == "env://" and (call["rank"], call["world_size"]) == (1, 2)
    assert call["timeout"] == datetime.timedelta(minutes=7)


def test_slurm_environment(fake_init):
    slurm = {"SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2",
             "SLURM_JOB_NODELIST": "node[01-02]"}
    env = init_distributed({"distributed": {"port": 29511}}, environ=slurm)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert fake_init[0]["init_method"] == "tcp://node01:29511"


def test_torchrun_wins_over_slurm(clean_env):
    layout = detect_launcher({}, {"RANK": "0", "WORLD_SIZE": "2", "SLURM_NTASKS": "4", "SLURM_PROCID": "2"})
    assert layout["source"] == "torchrun" and layout["world_size"] == 2


def test_init_method_from_config(fake_init):
    cfg = {"distributed": {"init_method": "tcp://10.0.0.1:23456", "rank": 1, "world_size": 2}}
    env = init_distributed(cfg, environ={})
    assert (env.rank, env.world_size) == (1, 2)
    assert fake_init[0]["init_method"] == "tcp://10.0.0.1:23456"


def test_init_method_rank_outside_world_is_a_user_error(clean_env):
    with pytest.raises(UserError, match="distributed.rank=2 is outside distributed.world_size=2"):
        detect_launcher({"distributed": {"init_method": "tcp://h:1", "rank": 2, "world_size": 2}}, {})


TORCHRUN_2 = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}


def test_world_size_mismatch_is_a_user_error(fake_init):
    with pytest.raises(UserError) as info:
        init_distributed({"distributed": {"world_size": 4}}, environ=TORCHRUN_2)
    assert str(info.value) == ("distributed.world_size=4 but the launcher started 2 processes; "
                               "set distributed.world_size=2")
    assert fake_init == []


@pytest.mark.parametrize("configured", [None, 1, 2])
def test_world_size_unset_or_equal_is_accepted(fake_init, configured):
    env = init_distributed({"distributed": {"world_size": configured}}, environ=TORCHRUN_2)
    assert env.world_size == 2


def test_nccl_knobs_exported_only_when_set(fake_init):
    import os

    init_distributed({"distributed": {"nccl": {"nsocks_perthread": 4, "socket_nthreads": None}}})
    assert os.environ["NCCL_NSOCKS_PERTHREAD"] == "4"
    assert "NCCL_SOCKET_NTHREADS" not in os.environ


@pytest.mark.parametrize("backend,match", [("ncl", "distributed.backend='ncl'"),
                                           ("nccl", "distributed.backend=nccl needs CUDA")])
def test_bad_backend_is_a_user_error(fake_init, backend, match):
    if backend == "nccl" and torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(UserError, match=match):
        init_distributed({"distributed": {"backend": backend}}, environ=TORCHRUN_2)


@pytest.mark.parametrize("device,match", [("tpu", "training.device='tpu'"), ("cuda:x", "cuda:N"),
                                          ("cpu:1", "cuda:N"), ("cuda", "no CUDA device"),
                                          ("cuda:0", "no CUDA device")])
def test_bad_or_unavailable_device_is_a_user_error(monkeypatch, device, match):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match=match):
        init_distributed({"training": {"device": device}}, environ={})
    for ok in ("auto", "cpu", "CPU"):
        assert init_distributed({"training": {"device": ok}}, environ={}).device == torch.device("cpu")


def test_seeds():
    seed_everything(3, rank=0)
    a = (random.random(), torch.rand(1))
    seed_everything(3, rank=1)
    b = (random.random(), torch.rand(1))
    seed_for_init(3)
    c = (random.random(), torch.rand(1))
    assert a[0] != b[0] and not torch.equal(a[1], b[1])
    assert a[0] == c[0] and torch.equal(a[1], c[1])  # init seed = rank-0 seed on every rank


def test_destroy_without_group_is_a_no_op():
    destroy()


def test_a_group_made_again_in_the_process_reads_none_of_the_last_ones_keys(clean_env):
    """torch names each default group ``0`` again, and torchrun's store outlives it: a group made
    after ``destroy`` (a second Engine in a notebook or sweep) must not read the last group's
    addresses (stale: its peers fail to connect or hang), so each later group gets a fresh prefix."""
    import mmvl.distributed.init as init_mod

    agent, joined, stale = dist.HashStore(), [False], []  # the launcher's store, outliving groups

    def init_process_group(backend, timeout, rank, world_size, init_method=None, store=None):
        group = dist.PrefixStore("0/", dist.PrefixStore("default_pg", store or agent))  # as torch does
        stale.append(group.check(["rank_0_address"]))
        group.set("rank_0_address", f"group {len(stale)}")
        joined[0] = True

    clean_env.setattr(init_mod, "_groups_made", [0])
    clean_env.setattr(dist, "init_process_group", init_process_group)
    clean_env.setattr(dist, "is_initialized", lambda: joined[0])
    clean_env.setattr(dist, "rendezvous", lambda url, rank, world_size, timeout: iter([(agent, rank, world_size)]))
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    for _ in range(3):
        assert init_distributed({}, environ=torchrun).world_size == 2
        joined[0] = False  # destroyed
    assert stale == [False, False, False]


# -- which GPU each process takes (FakeGPUs: the decision, not a kernel) ----------------------------

def _slurm(local_id: int, per_node: int = 4) -> dict[str, str]:
    return {"SLURM_NTASKS": str(per_node), "SLURM_PROCID": str(local_id), "SLURM_LOCALID": str(local_id),
            "SLURM_NTASKS_PER_NODE": str(per_node), "SLURM_JOB_NODELIST": "gpu01"}


@pytest.mark.parametrize("local_id", [0, 1, 3])
def test_slurm_one_gpu_per_task_takes_the_one_gpu_it_sees(clean_env, fake_init, local_id):
    """``srun --gpus-per-task=1``: each task sees only its own GPU, as cuda:0."""
    gpus = FakeGPUs(clean_env, count=1)
    env = init_distributed({}, environ=_slurm(local_id))
    assert (env.local_rank, env.device) == (local_id, torch.device("cuda", 0))
    assert gpus.set_calls == [0] and fake_init[0]["backend"] == "nccl"


def test_slurm_two_gpus_per_task(clean_env, fake_init):
    gpus = FakeGPUs(clean_env, count=2)
    assert init_distributed({}, environ=_slurm(3)).device == torch.device("cuda", 1)
    assert gpus.set_calls == [1]


@pytest.mark.parametrize("local_rank", [0, 1])
def test_torchrun_rank_takes_its_local_gpu(clean_env, fake_init, local_rank):
    gpus = FakeGPUs(clean_env, count=2)
    env = init_distributed({}, environ={**TORCHRUN_2, "RANK": str(local_rank), "LOCAL_RANK": str(local_rank)})
    assert env.device == torch.device("cuda", local_rank) and gpus.set_calls == [local_rank]


def test_torchrun_with_more_local_ranks_than_gpus_is_a_user_error(clean_env, fake_init):
    FakeGPUs(clean_env, count=1)
    with pytest.raises(UserError, match="local rank 1 \\(torchrun\\) but only 1 CUDA devices"):
        init_distributed({}, environ={**TORCHRUN_2, "RANK": "1", "LOCAL_RANK": "1"})
    assert fake_init == []
