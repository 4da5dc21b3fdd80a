"""FSDP2 on 2 gloo ranks equals one process; full and sharded (DCP) checkpoints move across world sizes."""
from __future__ import annotations

import os

import pytest
import torch

from dist_checks import HALF, STEPS
from dist_contract import StrategyContract, assert_params_close
from dist_models import build, full_params, make_config, train
from mmvl.distributed.env import DistEnv
from mmvl.distributed.strategies.fsdp import FSDPStrategy
from mmvl.errors import UserError


@pytest.mark.proc
class TestFSDP(StrategyContract):
    strategy = "fsdp"
    cls_name = "FSDPStrategy"

    def test_activation_checkpointing_changes_nothing(self, ranks, ref):
        assert_params_close(ranks[0]["gc"], ref["clip"])
        torch.testing.assert_close(torch.tensor(ranks[0]["gc_norms"]), torch.tensor(ref["clip_norms"]),
                                   rtol=1e-5, atol=1e-7)

    def test_sharded_checkpoint_resumes_at_world2(self, ranks, ref):
        assert ranks[0]["sharded_files"] == [".metadata", "COMPLETE.json", "__0_0.distcp", "__1_0.distcp"]
        assert_params_close(ranks[0]["sharded_resumed"], ref["plain"])

    @pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
    def test_sharded_checkpoint_reshards_to_one_process(self, ranks, ref, workdir):
        # the world-2 DCP directory loads into a plain single-process model (no process group)
        strat, model, opt = build(self.model_name, "single")
        fsdp = FSDPStrategy(make_config("fsdp"), DistEnv())
        fsdp.load_sharded_state(model, opt, os.path.join(workdir, "sharded"))
        train(strat, model, opt, self.model_name, range(HALF, STEPS))
        assert_params_close(full_params(strat, model), ref["plain"])


    def test_bf16_mixed_precision(self, ranks):
        r = ranks[0]
        assert r["bf16_output_dtype"] == "torch.bfloat16"
        assert r["bf16_param_dtypes"] == ["torch.float32"]  # sharded master weights stay fp32
        assert all(n == n and 0 < n < 100 for n in r["bf16_norms"])
        assert r["bf16_moved"] > 0


def _engine_param_dtypes(env, precision):
    """The dtype a sharded Linear's weight has inside forward, and the policy's, under
    ``Engine(precision=..., strategy="fsdp")`` (the strategy gets the Engine's dtype)."""
    from mmvl.engine import Engine

    engine = Engine(env=env, precision=precision, strategy="fsdp")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    seen = []
    model[0].register_forward_pre_hook(lambda module, args: seen.append(str(module.weight.dtype)))
    model, _ = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with engine.autocast():
        out = model(torch.randn(3, 4))
    policy = model._get_fsdp_state()._mp_policy
    return {"in_forward": seen, "policy": str(policy.param_dtype), "out": str(out.dtype)}


@pytest.mark.parametrize("precision,dtype", [("bf16", "torch.bfloat16"),
                                             pytest.param("fp32", "None", marks=pytest.mark.slow)])
@pytest.mark.proc
def test_engine_precision_reaches_the_fsdp_policy(precision, dtype):
    from tests.distributed.dist_launch import launch

    for rank in launch(_engine_param_dtypes, world_size=2, args=(precision,)):
        assert rank["policy"] == dtype
        assert rank["in_forward"] == ["torch.float32" if dtype == "None" else dtype]


def test_sharded_checkpoint_flag():
    cfg = make_config("fsdp")
    cfg.distributed.sharded_checkpoint = True
    assert FSDPStrategy(cfg, DistEnv()).sharded_checkpoint
    assert not FSDPStrategy(make_config("fsdp"), DistEnv()).sharded_checkpoint


# -- on a GPU (pytest -m cuda): FSDP2 over NCCL at world size 1 ----------------------------------------

@pytest.fixture
def nccl_world_of_one():
    import torch.distributed as dist

    from dist_launch import free_port

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield DistEnv(device=torch.device("cuda", 0), backend="nccl")
    finally:
        dist.destroy_process_group()


def _train_on_cuda(name: str, env: DistEnv, steps: range, precision: str = "fp32", state=None):
    """The transformer, wrapped by strategy ``name`` directly (build_strategy would run fsdp at world
    size 1 as single), trained on the GPU; optionally resumed from a full ``state`` first."""
    from dist_models import EPS, LR, MODELS, batch
    from mmvl.distributed.init import seed_for_init
    from mmvl.registry import STRATEGIES

    seed_for_init(0)
    model = MODELS["transformer"]().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    strategy = STRATEGIES.get(name)(make_config(name, precision=precision), env)
    model, optimizer = strategy.wrap(model, optimizer)
    if state is not None:
        strategy.load_model_state_dict(model, state["model"])
        strategy.load_optimizer_state_dict(model, optimizer, state["optimizer"])
    for step in steps:
        x, y = (t.cuda() for t in batch(step, "transformer"))
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x).float(), y).backward()
        optimizer.step()
    return strategy, model, optimizer


@pytest.mark.cuda
def test_fsdp_at_world_size_one_on_cuda(nccl_world_of_one):
    from dist_checks import roundtrip
    from dist_models import batch

    env = nccl_world_of_one
    single, s_model, _ = _train_on_cuda("single", env, range(6))
    fsdp, f_model, _ = _train_on_cuda("fsdp", env, range(6))
    assert all(hasattr(p, "to_local") for p in f_model.parameters())  # really sharded (DTensors)
    uninterrupted = full_params(fsdp, f_model)
    assert_params_close(uninterrupted, full_params(single, s_model))
    # a full checkpoint at update 3 (the portable format), resumed on a fresh FSDP model
    _, h_model, h_opt = _train_on_cuda("fsdp", env, range(3))
    state = roundtrip({"model": fsdp.model_state_dict(h_model), "optimizer": fsdp.optimizer_state_dict(h_model, h_opt)})
    assert sorted(state["optimizer"]["state"]) == list(range(len(uninterrupted)))
    resumed, r_model, _ = _train_on_cuda("fsdp", env, range(3, 6), state=state)
    assert_params_close(full_params(resumed, r_model), uninterrupted, atol=1e-6)
    # bf16 mixed precision: bf16 compute, fp32 sharded master weights
    _, b_model, _ = _train_on_cuda("fsdp", env, range(2), precision="bf16")
    assert {p.dtype for p in b_model.parameters()} == {torch.float32}
    with torch.no_grad():
        assert b_model(batch(0, "transformer")[0].cuda()).dtype == torch.bfloat16
