"""Checks run inside one spawned 2-rank group, and the single-process reference they are held to.

Spawning is the slow part (each rank imports torch), so one group runs every
strategy's checks plus the collectives' checks; a failure in one plan is
recorded and reported by that plan's tests only.
"""
from __future__ import annotations

import io
import os
import traceback
from typing import Any

import torch
import torch.distributed as dist

from dist_models import LR, batch, build, full_params, local_optimizer_state_bytes, make_config, train
from mmvl.engine import load_sharded, save_sharded
from mmvl.distributed.init import seed_for_init
from mmvl.distributed.strategies import build_strategy

STEPS = 20
HALF = 10
CLIP = 0.05
RUNS = {"plain": (1, None), "accum": (2, None), "clip": (1, CLIP), "accum_clip": (2, CLIP)}
#: strategy -> (model, extra checks run in the same group)
PLANS = {
    "ddp": ("mlp", ("comm_count", "keys")),
    "zero_fairscale": ("mlp", ("int_step", "keys")),
    "zero_torch": ("mlp", ("int_step", "keys")),
    "fsdp": ("transformer", ("checkpointing", "sharded", "bf16", "keys")),
}
#: registered strategies that run in one process: held to the reference in that process
#: (tests/distributed/test_dist_one_process.py); with PLANS, every registered strategy
ONE_PROCESS = {"single": "mlp", "dp": "mlp"}
#: ``distributed.*`` keys each strategy honours, checked for what their names say by ``_keys``
KEYS = {"ddp": ("broadcast_buffers",), "zero_torch": ("broadcast_buffers",),
        "zero_fairscale": ("broadcast_buffers", "broadcast_fp16", "reduce_buffer_size"),
        "fsdp": ("reshard_after_forward",)}


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


def _resume(env, name: str, model_name: str, ckpt: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Load a full checkpoint through the strategy at world 2 and finish the run."""
    strat, model, opt = build(model_name, name, env)
    strat.load_model_state_dict(model, ckpt["model"])
    strat.load_optimizer_state_dict(model, opt, ckpt["optimizer"])
    train(strat, model, opt, model_name, range(HALF, STEPS), env.rank, env.world_size)
    return full_params(strat, model)


def _equivalence_runs(env, name: str, model_name: str) -> dict[str, Any]:
    """The RUNS at world 2; plus per-rank optimizer state size and whether ranks agree."""
    out: dict[str, Any] = {}
    for run, (accum, clip) in RUNS.items():
        strat, model, opt = build(model_name, name, env)
        out["strategy"] = type(strat).__name__
        out[f"{run}_norms"] = train(strat, model, opt, model_name, range(STEPS), env.rank, env.world_size,
                                    accum, clip)
        out[run] = full_params(strat, model)
        if run == "plain":
            out["state_bytes"] = local_optimizer_state_bytes(opt)
            # replicated strategies: every rank holds the same full parameters after each update
            local = None if name == "fsdp" else strat.unwrap(model).state_dict()
            gathered = [None] * env.world_size
            dist.all_gather_object(gathered, local)
            out["ranks_agree"] = local is None or all(
                all(torch.equal(g[k], gathered[0][k]) for k in g) for g in gathered)
    return out


def _portable_checkpoints(env, name: str, model_name: str, world1_ckpt: str) -> dict[str, Any]:
    """A world-2 full checkpoint at HALF (resumed by the parent), and the world-1 one resumed here."""
    out: dict[str, Any] = {}
    strat, model, opt = build(model_name, name, env)
    train(strat, model, opt, model_name, range(HALF), env.rank, env.world_size)
    ckpt = {"model": strat.model_state_dict(model), "optimizer": strat.optimizer_state_dict(model, opt)}
    if env.rank == 0:
        out["ckpt"] = roundtrip(ckpt)
    out["resumed"] = _resume(env, name, model_name, torch.load(world1_ckpt, weights_only=True))
    return out


def _int_step(env, name, model_name, world1_ckpt, workdir) -> dict[str, Any]:
    """Checkpoints from older torch stored Adam's step as an int (fairscale#1083)."""
    legacy = torch.load(world1_ckpt, weights_only=True)
    for entry in legacy["optimizer"]["state"].values():
        entry["step"] = int(entry["step"])
    return {"resumed_int_step": _resume(env, name, model_name, legacy)}


def _checkpointing(env, name, model_name, world1_ckpt, workdir) -> dict[str, Any]:
    strat, model, opt = build(model_name, name, env, gradient_checkpointing=True)
    norms = train(strat, model, opt, model_name, range(STEPS), env.rank, env.world_size, 2, CLIP)
    return {"gc_norms": norms, "gc": full_params(strat, model)}


def _bf16(env, name, model_name, world1_ckpt, workdir) -> dict[str, Any]:
    """Mixed precision: bf16 compute, fp32 sharded master weights."""
    strat, model, opt = build(model_name, name, env, precision="bf16")
    before = full_params(strat, model)
    out: dict[str, Any] = {"bf16_norms": train(strat, model, opt, model_name, range(3), env.rank,
                                               env.world_size, 1, CLIP)}
    out["bf16_param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    with torch.no_grad():
        out["bf16_output_dtype"] = str(model(batch(0, model_name)[0]).dtype)
    after = full_params(strat, model)
    if env.rank == 0:
        out["bf16_moved"] = min((after[k] - before[k]).abs().max().item() for k in before)
    return out


def strategy_checks(env, name: str, model_name: str, world1_ckpt: str, workdir: str,
                    extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """Everything one strategy is held to, on this rank."""
    os.makedirs(workdir, exist_ok=True)
    out: dict[str, Any] = {"rank": env.rank, "world": env.world_size}
    out.update(_equivalence_runs(env, name, model_name))
    out.update(_portable_checkpoints(env, name, model_name, world1_ckpt))
    for check in extra:
        out.update(EXTRA[check](env, name, model_name, world1_ckpt, workdir))
    return out


def _count_allreduces(env, name, model_name, world1_ckpt, workdir) -> dict[str, int]:
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


def _sharded_roundtrip(env, name, model_name, world1_ckpt, workdir) -> dict[str, Any]:
    """DCP save at world 2 after HALF updates, reload into a fresh model, finish the run."""
    directory = os.path.join(workdir, "sharded")
    strat, model, opt = build(model_name, name, env)
    train(strat, model, opt, model_name, range(HALF), env.rank, env.world_size)
    save_sharded(directory, strat, model, opt)
    dist.barrier()
    strat, model, opt = build(model_name, name, env)
    load_sharded(directory, strat, model, opt)
    train(strat, model, opt, model_name, range(HALF, STEPS), env.rank, env.world_size)
    files = sorted(os.listdir(directory))
    return {"sharded_resumed": full_params(strat, model), "sharded_files": files,
            "sharded_flag": strat.sharded_checkpoint}


def _buffer_after_forward(env, name: str, broadcast: bool) -> float:
    """Rank-specific BatchNorm statistics before one forward: what this rank holds after it."""
    seed_for_init(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4, momentum=None))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    strat = build_strategy(make_config(name, {"broadcast_buffers": broadcast}), env)
    model, optimizer = strat.wrap(model, optimizer)
    strat.unwrap(model)[1].num_batches_tracked.fill_(10 * (env.rank + 1))
    model(torch.randn(4, 4)).sum().backward()
    return float(strat.unwrap(model)[1].num_batches_tracked)


def _keys(env, name, model_name, world1_ckpt, workdir) -> dict[str, Any]:
    """Each ``distributed.*`` key in ``KEYS[name]`` set away from its default does what it says."""
    out: dict[str, Any] = {}
    if "broadcast_buffers" in KEYS[name]:
        out["buffers_broadcast"] = _buffer_after_forward(env, name, True)
        out["buffers_own"] = _buffer_after_forward(env, name, False)
    if "broadcast_fp16" in KEYS[name]:
        for fp16 in (False, True):
            strat, model, opt = build(model_name, name, env, {"broadcast_fp16": fp16})
            train(strat, model, opt, model_name, range(2), env.rank, env.world_size)
            out[f"fp16_rounded_{fp16}"] = all(torch.equal(p, p.half().float()) for p in model.parameters())
    if "reduce_buffer_size" in KEYS[name]:
        for size in (0, 2**23):
            strat, model, opt = build(model_name, name, env, {"reduce_buffer_size": size})
            train(strat, model, opt, model_name, range(STEPS), env.rank, env.world_size)
            out[f"buckets_{size}"] = len(model._bucket_list)
            out[f"params_buckets_{size}"] = full_params(strat, model)
    if "reshard_after_forward" in KEYS[name]:
        for reshard in (True, False):
            strat, model, opt = build(model_name, name, env, {"reshard_after_forward": reshard})
            model(batch(0, model_name)[0])  # the forward only: what each layer holds until its backward
            out[f"layer_params_after_forward_{reshard}"] = sorted({type(p).__name__ for u in model.layers
                                                                   for p in u.parameters()})
            train(strat, model, opt, model_name, range(STEPS), env.rank, env.world_size)
            out[f"params_reshard_{reshard}"] = full_params(strat, model)
    return out


EXTRA = {"int_step": _int_step, "comm_count": _count_allreduces, "checkpointing": _checkpointing,
         "bf16": _bf16, "sharded": _sharded_roundtrip, "keys": _keys}


def run_all(env, world1_ckpts: dict[str, str], workdir: str) -> dict[str, Any]:
    """Every plan on this rank; an exception is kept as text under ``"error"`` for that plan."""
    from dist_comm_checks import comm_checks

    out: dict[str, Any] = {}
    for name, (model_name, extra) in PLANS.items():
        try:
            out[name] = strategy_checks(env, name, model_name, world1_ckpts[model_name],
                                        os.path.join(workdir, name), extra)
        except Exception:  # noqa: BLE001 - reported by this strategy's tests
            out[name] = {"error": traceback.format_exc()}
        dist.barrier()
    try:
        out["comm"] = comm_checks(env)  # last: it ends with a deliberately timed-out collective
    except Exception:  # noqa: BLE001
        out["comm"] = {"error": traceback.format_exc()}
    return out
