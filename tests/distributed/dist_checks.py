"""Checks run inside one 2-rank group per strategy, and the single-process reference they are held to.

One spawned group runs every check of a strategy (spawning is the slow part).
"""
from __future__ import annotations

import io
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_models import build, full_params, local_optimizer_state_bytes, train

STEPS = 20
HALF = 10
CLIP = 0.05
RUNS = {"plain": (1, None), "accum": (2, None), "clip": (1, CLIP), "accum_clip": (2, CLIP)}


def roundtrip(obj: Any) -> Any:
    """Through torch.save / torch.load(weights_only=True), as a checkpoint file would go."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def reference(model_name: str, workdir: str) -> dict[str, Any]:
    """Single-process results, and the world-1 checkpoint at update ``HALF`` (written to ``workdir``)."""
    out: dict[str, Any] = {}
    for run, clip in (("plain", None), ("clip", CLIP)):
        strat, model, opt = build(model_name, "single")
        out[f"{run}_norms"] = train(strat, model, opt, model_name, range(STEPS), clip=clip)
        out[run] = full_params(strat, model)
        out["state_bytes"] = sum(v.numel() * v.element_size() for e in opt.state.values()
                                 for v in e.values() if torch.is_tensor(v))
    strat, model, opt = build(model_name, "single")
    train(strat, model, opt, model_name, range(HALF))
    path = os.path.join(workdir, "world1.pt")
    torch.save({"model": strat.model_state_dict(model),
                "optimizer": strat.optimizer_state_dict(model, opt)}, path)
    out["world1_ckpt"] = path
    return out


def resume_single(model_name: str, ckpt: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Load a (world-2) full checkpoint in one process and finish the run."""
    strat, model, opt = build(model_name, "single")
    strat.load_model_state_dict(model, ckpt["model"])
    strat.load_optimizer_state_dict(model, opt, ckpt["optimizer"])
    train(strat, model, opt, model_name, range(HALF, STEPS))
    return full_params(strat, model)


def strategy_checks(env, name: str, model_name: str, world1_ckpt: str, workdir: str,
                    extra: tuple[str, ...] = ()) -> dict[str, Any]:
    rank, world = env.rank, env.world_size
    out: dict[str, Any] = {"rank": rank, "world": world}
    for run, (accum, clip) in RUNS.items():
        strat, model, opt = build(model_name, name, env)
        out["strategy"] = type(strat).__name__
        out[f"{run}_norms"] = train(strat, model, opt, model_name, range(STEPS), rank, world, accum, clip)
        out[run] = full_params(strat, model)
        if run == "plain":
            out["state_bytes"] = local_optimizer_state_bytes(opt)
            # every rank holds the same full parameters after an update (sharded ones once gathered)
            gathered = [None] * world
            dist.all_gather_object(gathered, {k: v for k, v in strat.unwrap(model).state_dict().items()}
                                   if name != "fsdp" else None)
            out["ranks_agree"] = name == "fsdp" or all(
                all(torch.equal(g[k], gathered[0][k]) for k in g) for g in gathered)

    # world 2 -> checkpoint at HALF (the parent resumes it in one process)
    strat, model, opt = build(model_name, name, env)
    train(strat, model, opt, model_name, range(HALF), rank, world)
    ckpt = {"model": strat.model_state_dict(model), "optimizer": strat.optimizer_state_dict(model, opt)}
    if rank == 0:
        out["ckpt"] = roundtrip(ckpt)

    # world 1 checkpoint -> resume at world 2
    loaded = torch.load(world1_ckpt, weights_only=True)
    strat, model, opt = build(model_name, name, env)
    strat.load_model_state_dict(model, loaded["model"])
    strat.load_optimizer_state_dict(model, opt, loaded["optimizer"])
    train(strat, model, opt, model_name, range(HALF, STEPS), rank, world)
    out["resumed"] = full_params(strat, model)

    if "int_step" in extra:  # checkpoints from older torch stored Adam's step as an int (fairscale#1083)
        legacy = torch.load(world1_ckpt, weights_only=True)
        for entry in legacy["optimizer"]["state"].values():
            entry["step"] = int(entry["step"])
        strat, model, opt = build(model_name, name, env)
        strat.load_model_state_dict(model, legacy["model"])
        strat.load_optimizer_state_dict(model, opt, legacy["optimizer"])
        train(strat, model, opt, model_name, range(HALF, STEPS), rank, world)
        out["resumed_int_step"] = full_params(strat, model)
    if "comm_count" in extra:
        out.update(_count_allreduces(env, model_name))
    if "checkpointing" in extra:
        strat, model, opt = build(model_name, name, env, gradient_checkpointing=True)
        out["gc_norms"] = train(strat, model, opt, model_name, range(STEPS), rank, world, 2, CLIP)
        out["gc"] = full_params(strat, model)
    if "sharded" in extra:
        out.update(_sharded_roundtrip(env, name, model_name, workdir))
    return out


def _count_allreduces(env, model_name: str) -> dict[str, int]:
    """DDP comm-hook calls per update: once per bucket per synced backward, so accumulation adds none."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    strat, model, opt = build(model_name, "ddp", env)
    calls = [0]

    def counting_hook(state, bucket):
        calls[0] += 1
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_hook)
    args = (strat, model, opt, model_name)
    train(*args, range(1), env.rank, env.world_size)  # warm-up (DDP may rebuild buckets after it)
    calls[0] = 0
    train(*args, range(1, 2), env.rank, env.world_size)
    per_update = calls[0]
    calls[0] = 0
    train(*args, range(2, 5), env.rank, env.world_size, accum=4)
    with_no_sync = calls[0]
    calls[0] = 0
    train(*args, range(5, 6), env.rank, env.world_size, accum=4, sync=False)
    without_no_sync = calls[0]
    return {"allreduce_per_update": per_update, "allreduce_3_updates_accum4": with_no_sync,
            "allreduce_1_update_accum4_no_no_sync": without_no_sync}


def _sharded_roundtrip(env, name: str, model_name: str, workdir: str) -> dict[str, Any]:
    """DCP save at world 2 after HALF updates, reload into a fresh model, finish the run."""
    directory = os.path.join(workdir, "sharded")
    strat, model, opt = build(model_name, name, env)
    train(strat, model, opt, model_name, range(HALF), env.rank, env.world_size)
    strat.save_sharded_state(model, opt, directory)
    dist.barrier()
    strat, model, opt = build(model_name, name, env)
    strat.load_sharded_state(model, opt, directory)
    train(strat, model, opt, model_name, range(HALF, STEPS), env.rank, env.world_size)
    files = sorted(os.listdir(directory))
    return {"sharded_resumed": full_params(strat, model), "sharded_files": files,
            "sharded_flag": strat.sharded_checkpoint}


def assert_params_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float = 1e-5) -> None:
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=atol, rtol=0, msg=lambda m: f"{key}: {m}")


class StrategyContract:
    """Every strategy, run on 2 gloo ranks, against the single-process reference.

    Subclasses set ``strategy`` (registry name), ``cls_name`` (the class that
    must actually run: no silent fallback), ``model_name``, ``sharded`` and
    ``extra`` (additional checks run inside the same spawned group).
    """

    strategy: str
    cls_name: str
    model_name = "mlp"
    sharded = True
    extra: tuple[str, ...] = ()

    @pytest.fixture(scope="class")
    @classmethod
    def ref(cls, tmp_path_factory):
        return reference(cls.model_name, str(tmp_path_factory.mktemp("ref")))

    @pytest.fixture(scope="class")
    @classmethod
    def workdir(cls, tmp_path_factory):
        return str(tmp_path_factory.mktemp("work"))

    @pytest.fixture(scope="class")
    @classmethod
    def ranks(cls, ref, workdir):
        from dist_launch import launch

        return launch(strategy_checks, world_size=2, timeout=240,
                      args=(cls.strategy, cls.model_name, ref["world1_ckpt"], workdir, cls.extra))

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
                assert rank["state_bytes"] <= 0.55 * ref["state_bytes"], (rank["state_bytes"], ref["state_bytes"])
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
