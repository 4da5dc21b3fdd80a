"""DDP on 2 gloo ranks equals one process; accumulation communicates once per update."""
from __future__ import annotations

import pytest
import torch

from dist_contract import StrategyContract
from dist_models import make_config
from mmvl.config.schema import section
from mmvl.distributed.env import DistEnv
from mmvl.distributed.strategies import build_strategy, resolve_strategy_name
from mmvl.errors import UserError


@pytest.mark.proc
class TestDDP(StrategyContract):
    strategy = "ddp"
    cls_name = "DDPStrategy"
    sharded = False

    def test_accumulation_all_reduces_once_per_update(self, ranks):
        r = ranks[0]
        assert r["allreduce_per_update"] >= 1
        # 3 updates x 4 micro-steps: gradients travel only on each update's last micro-step
        assert r["allreduce_3_updates_accum4"] == 3 * r["allreduce_per_update"]
        # the hook does count every synced backward: without no_sync it is 4x
        assert r["allreduce_1_update_accum4_no_no_sync"] == 4 * r["allreduce_per_update"]


@pytest.mark.parametrize("config,env,want", [
    ({}, DistEnv(), "single"),
    ({}, DistEnv(world_size=2, rank=1), "ddp"),
    ({"optimizer": {"enable_state_sharding": True}}, DistEnv(world_size=2), "zero_fairscale"),
    ({"distributed": {"data_parallel": True}}, DistEnv(), "single"),  # dp needs >1 CUDA device
    ({"distributed": {"strategy": "fsdp"}}, DistEnv(), "fsdp"),
])
def test_auto_resolution(config, env, want):
    assert resolve_strategy_name(config, env) == want


@pytest.mark.parametrize("name", ["ddp", "fsdp", "zero_torch", "zero_fairscale"])
def test_process_group_strategy_without_group_is_a_user_error(name):
    """Training one process unwrapped is not what distributed.strategy=<name> asked for."""
    with pytest.raises(UserError, match=f"distributed.strategy={name} needs several processes.*"
                                        "distributed.world_size=<N>"):
        build_strategy(make_config(name), DistEnv())


@pytest.mark.parametrize("strategy,world,want", [
    ("auto", 1, "single"),  # one process: nothing to split
    ("auto", 2, "zero_fairscale"),  # what MMF built: fairscale OSS + ShardedDDP
    ("zero_torch", 2, "zero_torch"), ("fsdp", 2, "fsdp"), ("zero_fairscale", 2, "zero_fairscale"),
])
def test_enable_state_sharding_picks_a_sharding_strategy(strategy, world, want):
    config = {"optimizer": {"enable_state_sharding": True}, "distributed": {"strategy": strategy}}
    assert resolve_strategy_name(config, DistEnv(world_size=world)) == want


@pytest.mark.parametrize("strategy", ["ddp", "dp", "single"])
def test_enable_state_sharding_with_a_replicating_strategy_is_a_user_error(strategy):
    config = {"optimizer": {"enable_state_sharding": True}, "distributed": {"strategy": strategy}}
    with pytest.raises(UserError, match=f"enable_state_sharding=true but distributed.strategy={strategy} "
                                        "keeps the whole optimizer state.*zero_fairscale"):
        resolve_strategy_name(config, DistEnv(world_size=2))


def test_ddp_options_from_config():
    from mmvl.distributed.strategies.ddp import ddp_options

    options = ddp_options(section(make_config("ddp", {"broadcast_buffers": False, "find_unused_parameters": True}),
                                  "distributed"))
    assert options["find_unused_parameters"] is True
    assert False in [options.get("forward_sync_buffers"), options.get("broadcast_buffers")]


def test_unknown_strategy_suggests_the_closest():
    with pytest.raises(UserError, match="zero_torch"):
        build_strategy(make_config("zero_torh"), DistEnv())


def test_rebuilt_optimizer_keeps_group_hyperparameters():
    from mmvl.distributed.strategies.base import Strategy

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW([{"params": [model.weight], "weight_decay": 0.1},
                             {"params": [model.bias], "weight_decay": 0.0, "lr": 0.5}], lr=0.01)
    groups = Strategy.param_groups(opt)
    rebuilt = torch.optim.AdamW(groups, **Strategy.optimizer_defaults(opt))
    assert [g["weight_decay"] for g in rebuilt.param_groups] == [0.1, 0.0]
    assert [g["lr"] for g in rebuilt.param_groups] == [0.01, 0.5]
    assert "decoupled_weight_decay" not in Strategy.optimizer_defaults(opt)


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore:torch.cuda.amp.GradScaler is enabled")
def test_scalers_and_unwrapped_strategies_on_cpu():
    from mmvl.distributed.strategies.dp import DataParallelStrategy
    from mmvl.distributed.strategies.zero_fairscale import ZeroFairscaleStrategy

    env = DistEnv()
    assert DataParallelStrategy(make_config("dp"), env).make_grad_scaler(False) is None
    assert type(ZeroFairscaleStrategy(make_config("zero_fairscale"), env).make_grad_scaler(True)).__name__ \
        == "ShardedGradScaler"
    model = torch.nn.Linear(2, 2)
    dp = DataParallelStrategy(make_config("dp"), env)
    wrapped, _ = dp.wrap(model, None)
    assert wrapped is model and dp.unwrap(wrapped) is model  # one or no GPU: nothing to replicate


@pytest.mark.parametrize("local_rank,device,want", [(1, torch.device("cuda", 1), [1]),
                                                    (3, torch.device("cuda", 0), [0]),  # --gpus-per-task=1
                                                    (1, torch.device("cpu"), None)])
def test_ddp_wraps_on_the_gpu_init_chose(monkeypatch, local_rank, device, want):
    """DDP's device_ids come from the device init_distributed chose, not from the local rank."""
    from mmvl.distributed.strategies import ddp

    seen = {}
    monkeypatch.setattr(ddp, "DistributedDataParallel", lambda model, device_ids, **kw: seen.update(ids=device_ids))
    ddp.wrap_ddp(torch.nn.Linear(2, 2), section(make_config("ddp"), "distributed"),
                 DistEnv(world_size=4, local_rank=local_rank, device=device))
    assert seen["ids"] == want
