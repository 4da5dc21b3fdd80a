"""FSDP2 on 2 gloo ranks equals one process; full and sharded (DCP) checkpoints move across world sizes."""
from __future__ import annotations

import os

import pytest
import torch

from dist_checks import HALF, STEPS
from dist_contract import StrategyContract, assert_params_close
from dist_models import build, full_params, make_config, train
from mmvl.distributed.env import DistEnv
from mmvl.distributed.strategies.fsdp import FSDPStrategy, precision_dtype
from mmvl.errors import UserError


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


@pytest.mark.parametrize("name,dtype", [("fp32", None), ("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_precision_policy(name, dtype):
    assert precision_dtype(make_config("fsdp", precision=name)) is dtype


def test_unknown_precision_is_a_user_error():
    with pytest.raises(UserError, match="training.precision='fp8'"):
        precision_dtype(make_config("fsdp", precision="fp8"))


def test_sharded_checkpoint_flag():
    cfg = make_config("fsdp")
    cfg.distributed.sharded_checkpoint = True
    assert FSDPStrategy(cfg, DistEnv()).sharded_checkpoint
    assert not FSDPStrategy(make_config("fsdp"), DistEnv()).sharded_checkpoint
