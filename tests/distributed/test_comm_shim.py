"""The checking shim itself: it passes mmvl's collectives and catches the device mistakes a GPU job
would die of (the contract tests in this folder all run under it: see ``conftest.dist_group``)."""
from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import torch
import torch.distributed as dist

from comm_shim import Claim, DeviceMisuse, device_of, on_gpu
from dist_launch import LaunchError
from mmvl.distributed import comm
from mmvl.distributed.env import DistEnv


# -- in this process: labels and checks ---------------------------------------------------------

def test_a_gpu_label_survives_what_comm_does_to_a_tensor():
    t = on_gpu(torch.arange(4.0), 1)
    for derived in (torch.zeros_like(t), t.new_zeros(2), torch.cat([t, t.new_zeros(1)]), t[:2],
                    t.reshape(2, 2).contiguous(), t / 2, torch.empty_like(t)):
        assert device_of(derived) == torch.device("cuda", 1)
    assert device_of(torch.tensor([1.0])) == torch.device("cpu")
    shim = Claim("nccl", local_rank=1)
    back = shim.place(t, torch.device("cpu"))
    assert type(back) is torch.Tensor and torch.equal(back, torch.arange(4.0))
    assert device_of(shim.place(torch.ones(1), torch.device("cuda", 1))) == torch.device("cuda", 1)


@pytest.mark.parametrize("tensor,message", [
    (torch.ones(1), "on cpu under nccl, which takes CUDA tensors only"),
    (on_gpu(torch.ones(1), 0), "on cuda:0 but this rank's collectives belong on cuda:1"),
    (None, None)])
def test_tensor_checks(tensor, message):
    shim = Claim("nccl", local_rank=1)
    if tensor is None:
        shim.check_tensors("all_reduce", (on_gpu(torch.ones(1), 1),), {})  # its own GPU: fine
        return
    with pytest.raises(DeviceMisuse, match=message):
        shim.check_tensors("all_reduce", ([tensor],), {})


def test_object_collectives_need_the_rank_s_gpu_current():
    shim = Claim("nccl", local_rank=1)
    with pytest.raises(DeviceMisuse, match="runs on cuda:0 .* call torch.cuda.set_device\\(1\\)"):
        shim.check_current("barrier")
    shim._set_device(1)
    shim.check_current("barrier")
    Claim("gloo", local_rank=1).check_current("barrier")  # gloo runs them on the CPU


# -- on 2 ranks: the defects the shim exists for --------------------------------------------------

class OldPreemptionFlag:
    """``callbacks/preemption.py`` as it was before issue 9 (its constructor, handler and the
    collective of ``on_update_end``, verbatim): a CPU flag all-reduced after every update."""

    def __init__(self, trainer: Any, **params: Any):
        self.trainer = trainer
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        self.received = signum

    def on_update_end(self, info: dict[str, Any]) -> bool:
        if self.trainer.env.world_size == 1 and not self.received:
            return False
        flag = torch.tensor([float(self.received or 0)])
        if self.trainer.env.world_size > 1:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())


class _Trainer:
    def __init__(self, env: DistEnv):
        self.env = env


def _old_preemption_flag(env) -> dict[str, Any]:
    callback = OldPreemptionFlag(_Trainer(env))
    if env.rank == 1:
        callback._handler(signal.SIGTERM, None)
    return {"stop": callback.on_update_end({})}


@pytest.mark.proc
def test_the_old_preemption_flag_passes_gloo_but_not_the_nccl_shim(launch):
    """The defect every CPU test missed: under gloo the flag works (every rank learns rank 1's signal);
    held to NCCL's rules it fails at the first update, as ddp/zero/fsdp on GPUs did."""
    assert [r["stop"] for r in launch(_old_preemption_flag, world_size=2, timeout=120)] == [True, True]
    with pytest.raises(LaunchError) as info:
        launch(_old_preemption_flag, world_size=2, timeout=120, claim="nccl")
    assert "DeviceMisuse: all_reduce got a tensor on cpu under nccl" in str(info.value)


def _old_env_from_process_group() -> DistEnv:
    """``mmvl/engine.py``'s ``_env_from_process_group`` before issue 9, verbatim: no ``set_device``."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    return DistEnv(rank=comm.get_rank(), world_size=comm.get_world_size(), local_rank=local_rank,
                   device=device, backend=(torch.distributed.get_backend()
                                           if comm.is_initialized() else None))


def _engines(shim) -> dict[str, Any]:
    """The stand-alone Engine in a torchrun job whose script joined the group itself: before issue 9
    (the Engine read the group and stayed on GPU 0) and now (it takes the rank's GPU)."""
    from mmvl.engine import Engine

    out: dict[str, Any] = {}
    with shim.gpus_visible(2):
        dist.init_process_group("nccl")
        old = Engine(env=_old_env_from_process_group())
    try:
        old.wait_for_everyone()
        out["old"] = None
    except DeviceMisuse as e:
        out["old"] = str(e)
        dist.barrier.__wrapped__()  # meet the rank that passed, so it does not wait for us
    shim.current = 0  # as in a fresh process
    with shim.gpus_visible(2):
        engine = Engine()
    out["device"] = str(engine.device)
    out["gathered"] = engine.gather(torch.tensor([float(engine.rank)])).tolist()
    engine.wait_for_everyone()
    return out


@pytest.mark.proc
def test_the_engine_takes_its_own_gpu_before_its_first_collective(launch):
    ranks = launch(_engines, world_size=2, timeout=180, claim="nccl", join=False)
    assert ranks[0]["old"] is None  # rank 0's GPU is GPU 0 anyway
    assert "barrier runs on cuda:0 (the current GPU) under nccl, but this rank's GPU is cuda:1" in ranks[1]["old"]
    assert [r["device"] for r in ranks] == ["cuda:0", "cuda:1"]
    assert all(r["gathered"] == [0.0, 1.0] for r in ranks)


def _trainer_run(env, root: str) -> dict[str, Any]:
    from mmvl.config import load_config
    from mmvl.trainers import Trainer
    from mmvl.trainers.callbacks import Callback
    from tests.fixtures.toy import register, toy_opts

    register()
    torch.set_num_threads(1)
    trainer = Trainer(load_config(toy_opts(root, "distributed.strategy=ddp", "training.max_updates=8",
                                           "training.preemption_check_interval=2")), env=env)

    class Signal(Callback):  # rank 1 is preempted after update 3: its flag crosses the ranks as NCCL would
        def on_update_end(self, info):
            if trainer.update == 3 and env.rank == 1:
                os.kill(os.getpid(), signal.SIGUSR1)

    trainer.callbacks.insert(0, Signal(trainer))
    trainer.fit()
    return {"update": trainer.update, "preempted": trainer.preempted,
            "val": trainer.evaluate("val")["toy"]["accuracy"]}


@pytest.mark.proc
def test_the_trainer_s_own_collectives_pass_the_nccl_shim(launch, tmp_path):
    """Loss checks, logging means, the preemption flag (started at update 4, read at 6), evaluation
    gathers, checkpoint RNG gathers: all on the rank's GPU."""
    ranks = launch(_trainer_run, world_size=2, args=(str(tmp_path),), timeout=240, claim="nccl")
    assert [(r["update"], r["preempted"]) for r in ranks] == [(6, "SIGUSR1")] * 2
    assert ranks[0]["val"] == ranks[1]["val"]
