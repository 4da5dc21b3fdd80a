"""ZeRO on 2 gloo ranks (fairscale OSS+ShardedDDP, torch ZeroRedundancyOptimizer) equals one process."""
from __future__ import annotations

import pytest
from dist_contract import StrategyContract, assert_params_close


@pytest.mark.proc
class TestZeroFairscale(StrategyContract):
    strategy = "zero_fairscale"
    cls_name = "ZeroFairscaleStrategy"

    def test_reloads_state_with_integer_step(self, ranks, ref):
        # fairscale#1083: OSS hands a loaded `step` to Adam as it finds it (int, or on the param's device)
        assert_params_close(ranks[0]["resumed_int_step"], ref["plain"])


@pytest.mark.proc
class TestZeroTorch(StrategyContract):
    strategy = "zero_torch"
    cls_name = "ZeroTorchStrategy"

    def test_reloads_state_with_integer_step(self, ranks, ref):
        assert_params_close(ranks[0]["resumed_int_step"], ref["plain"])
