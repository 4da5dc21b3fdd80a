"""The contract every strategy's tests check, against results from the shared 2-rank group."""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from dist_checks import CLIP, PLANS, RUNS, resume_single


def assert_params_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                        atol: float = 1e-5) -> None:
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=atol, rtol=0, msg=lambda m: f"{key}: {m}")


def plan_results(group: dict[str, Any], key: str) -> list[dict[str, Any]]:
    """One plan's per-rank results from the shared group, failing with the ranks' tracebacks."""
    ranks = [r[key] for r in group["ranks"]]
    errors = [f"rank {i}:\n{r['error']}" for i, r in enumerate(ranks) if "error" in r]
    if errors:
        pytest.fail(f"{key} failed inside the 2-rank group:\n" + "\n".join(errors), pytrace=False)
    return ranks


class StrategyContract:
    """Every strategy, run on 2 gloo ranks, against the single-process reference.

    Subclasses set ``strategy`` (a key of ``PLANS``), ``cls_name`` (the class
    that must actually run: no silent fallback) and ``sharded``.
    """

    strategy: str
    cls_name: str
    sharded = True

    @property
    def model_name(self) -> str:
        return PLANS[self.strategy][0]

    @pytest.fixture(scope="class")
    @classmethod
    def ref(cls, references):
        return references[PLANS[cls.strategy][0]]

    @pytest.fixture(scope="class")
    @classmethod
    def workdir(cls, dist_group):
        return os.path.join(dist_group["workdir"], cls.strategy)

    @pytest.fixture(scope="class")
    @classmethod
    def ranks(cls, dist_group):
        return plan_results(dist_group, cls.strategy)

    def test_runs_the_requested_strategy(self, ranks):
        assert [r["world"] for r in ranks] == [2, 2]
        assert ranks[0]["strategy"] == self.cls_name

    @pytest.mark.parametrize("run", list(RUNS))
    def test_parameters_match_single_process(self, ranks, ref, run):
        want = ref["clip" if RUNS[run][1] else "plain"]
        assert_params_close(ranks[0][run], want)

    def test_ranks_hold_identical_parameters(self, ranks):
        assert ranks[0]["ranks_agree"]

    @pytest.mark.parametrize("run", ["clip", "accum_clip"])
    def test_reported_grad_norm_is_global(self, ranks, ref, run):
        assert max(ref["clip_norms"]) > CLIP, "clipping must be active for this test to mean anything"
        for rank in ranks:
            torch.testing.assert_close(torch.tensor(rank[f"{run}_norms"]), torch.tensor(ref["clip_norms"]),
                                       rtol=1e-5, atol=1e-7)

    def test_optimizer_state_per_rank(self, ranks, ref):
        for rank in ranks:
            if self.sharded:
                assert rank["state_bytes"] <= 0.55 * ref["state_bytes"], (rank["state_bytes"],
                                                                           ref["state_bytes"])
            else:
                assert rank["state_bytes"] == ref["state_bytes"]

    def test_world2_checkpoint_resumes_in_one_process(self, ranks, ref):
        ckpt = ranks[0]["ckpt"]
        n_params = len(ref["plain"])
        assert sorted(ckpt["optimizer"]["state"]) == list(range(n_params)), "plain torch optimizer format"
        assert set(ckpt["model"]) == set(ref["plain"])
        assert_params_close(resume_single(self.model_name, ckpt), ref["plain"])

    def test_world1_checkpoint_resumes_at_world2(self, ranks, ref):
        assert_params_close(ranks[0]["resumed"], ref["plain"])

    def test_distributed_key_does_what_it_says(self, ranks, ref, key):
        """Parametrised over ``dist_checks.KEYS[strategy]`` (see conftest): each key set away from its
        default changes what its name says, and training still matches the single process."""
        if key == "broadcast_buffers":  # rank r starts at 10 * (r + 1) tracked batches; the forward adds 1
            assert [r["buffers_broadcast"] for r in ranks] == [11.0, 11.0]
            assert [r["buffers_own"] for r in ranks] == [11.0, 21.0]
        elif key == "broadcast_fp16":
            assert all(r["fp16_rounded_True"] for r in ranks) and not any(r["fp16_rounded_False"] for r in ranks)
        elif key == "reduce_buffer_size":
            assert ranks[0]["buckets_0"] == 0 and ranks[0][f"buckets_{2**23}"] > 0
            for size in (0, 2**23):
                assert_params_close(ranks[0][f"params_buckets_{size}"], ref["plain"])
        elif key == "reshard_after_forward":
            assert ranks[0]["layer_params_after_forward_True"] == ["DTensor"]  # freed back to shards
            assert ranks[0]["layer_params_after_forward_False"] == ["Parameter"]  # kept gathered
            for reshard in (True, False):
                assert_params_close(ranks[0][f"params_reshard_{reshard}"], ref["plain"])
        else:
            pytest.fail(f"no check written for distributed.{key}")
