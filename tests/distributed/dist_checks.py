"""Checks run inside one 2-rank group per strategy, and the single-process reference they are held to.

One spawned group runs every check of a strategy (spawning is the slow part).
"""
from __future__ import annotations

import io
import os
from typing import Any

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
    fresh = torch.load(world1_ckpt, weights_only=True)
    out["ckpt_untouched"] = all(
        torch.equal(fresh["optimizer"]["state"][i][k], loaded["optimizer"]["state"][i][k])
        for i in fresh["optimizer"]["state"] for k in fresh["optimizer"]["state"][i]
        if torch.is_tensor(fresh["optimizer"]["state"][i][k]))

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
