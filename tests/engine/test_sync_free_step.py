"""The Engine's update never waits for the device between log intervals, for every registered
optimizer and scheduler under fp32, bf16 and fp16 (CPU autocast and torch's real GradScaler), in one
process and under ddp at 2 gloo ranks: synchronising calls counted per update on the CPU
(tests/fixtures/syncs.py). The cases the docs list as costing a sync per update (an unfused
optimizer, ZeRO, sgd under fsdp) are counted too, so the cost table stays true."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from mmvl.distributed.env import DistEnv
from mmvl.engine import Engine
from mmvl.optim import build_optimizer, build_scheduler, optimizer_section, scheduler_section
from mmvl.registry import OPTIMIZERS, SCHEDULERS
from tests.distributed.dist_launch import launch
from tests.fixtures.syncs import SyncCounter

PRECISIONS = ("fp32", "bf16", "fp16")
LOG_INTERVAL, UPDATES = 3, 6
POISONED = 2  # under fp16 this update's gradients are infinite: the scaler skips it on the device
LR = {"adam_w": 1e-3, "adam": 1e-3, "sgd": 0.1}
SCHEDULE = {"warmup_linear": {"num_warmup_steps": 2}, "warmup_cosine": {"num_warmup_steps": 2},
            "constant": {"num_warmup_steps": 1}}


def _config(strategy: str, optimizer: str, scheduler: str, precision: str, fused: bool | None) -> Any:
    params = {"lr": LR.get(optimizer, 1e-3), **({} if fused is None else {"fused": fused})}
    return OmegaConf.create({
        "training": {"precision": precision, "max_updates": UPDATES},
        "distributed": {"strategy": strategy},
        "optimizer": {"type": optimizer, "params": params},
        "scheduler": {"type": scheduler, "params": dict(SCHEDULE.get(scheduler, {}))}})


def run_case(env: DistEnv, strategy: str, optimizer: str, scheduler: str, precision: str,
             fused: bool | None = None) -> dict[str, Any]:
    """A plain Engine loop of UPDATES updates (clipping on every other one), the schedule settled at
    each log interval as the Trainer does; the syncs seen within each update."""
    config = _config(strategy, optimizer, scheduler, precision, fused)
    engine = Engine(config, env=env)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    opt = build_optimizer(model, optimizer_section(config), device=engine.device)
    model, opt, sched = engine.prepare(model, opt, build_scheduler(opt, scheduler_section(config), UPDATES))
    x = torch.randn(4, 8) + env.rank
    per_update: list[list[str]] = []
    with SyncCounter() as counter:
        for update in range(1, UPDATES + 1):
            counter.calls.clear()
            with engine.accumulate(model), engine.autocast():
                loss = model(x).float().pow(2).mean()
            poison = precision == "fp16" and update == POISONED
            engine.backward(loss * (float("inf") if poison else 1e-3))  # 1e-3: fp16 stays finite
            if update % 2 == 0:
                engine.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad()
            sched.step()
            per_update.append([f"{what} at {where}" for what, where in counter.calls])
            if update % LOG_INTERVAL == 0:
                sched.settle()
    return {"syncs": per_update, "last_epoch": sched.last_epoch, "lr": opt.param_groups[0]["lr"],
            "fused": [bool(g.get("fused")) for g in opt.param_groups]}


CASES = [(o, s, p) for o in OPTIMIZERS.names() for s in SCHEDULERS.names() for p in PRECISIONS]


def test_the_registries_hold_what_the_issue_names():
    assert {"adam_w", "adam", "sgd"} <= set(OPTIMIZERS.names()) and len(CASES) >= 27


@pytest.mark.parametrize("optimizer,scheduler,precision", CASES)
def test_single_process_updates_do_not_sync(optimizer, scheduler, precision):
    result = run_case(DistEnv(), "single", optimizer, scheduler, precision)
    assert result["syncs"] == [[]] * UPDATES
    assert all(result["fused"])
    # the skipped fp16 update did not advance the schedule (settled at the log interval)
    assert result["last_epoch"] == UPDATES - (precision == "fp16")


@pytest.fixture
def step_lr():
    """A schedule that is not closed-form (StepLR computes from the groups' current lr)."""
    SCHEDULERS.register("test_step_lr", lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5))
    yield "test_step_lr"
    SCHEDULERS.unregister("test_step_lr")


def test_a_schedule_that_is_not_closed_form_steps_without_a_sync_and_is_replayed(step_lr):
    result = run_case(DistEnv(), "single", "sgd", step_lr, "fp16")
    assert result["syncs"] == [[]] * UPDATES
    # replayed at the log interval: halved once per update taken, not for the skipped one
    assert result["last_epoch"] == UPDATES - 1 and result["lr"] == pytest.approx(LR["sgd"] * 0.5 ** (UPDATES - 1))


def test_the_counter_sees_the_scalers_read_for_an_unfused_optimizer():
    """The documented cost: unfused, the scaler reads the finite flag (``.item()``) every update."""
    result = run_case(DistEnv(), "single", "adam_w", "constant", "fp16", fused=False)
    assert [len(calls) for calls in result["syncs"]] == [1] * UPDATES
    assert all("Tensor.item" in calls[0] and "grad_scaler" in calls[0] for calls in result["syncs"])


def test_an_unfused_optimizer_under_fp16_is_said_once(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="mmvl"):
        run_case(DistEnv(), "single", "adam_w", "constant", "fp16", fused=False)
        run_case(DistEnv(), "single", "adam_w", "constant", "fp16")
    said = [r.getMessage() for r in caplog.records if "host-device sync per update" in r.getMessage()]
    assert len(said) == 1 and "AdamW" in said[0]


#: the other strategies' fp16 cost, counted (see docs/precision.md): syncs per update
OTHERS = [("fsdp", "adam_w", 0), ("fsdp", "sgd", 1), ("zero_torch", "adam_w", 1)]


def _all_cases_on_two_ranks(env: DistEnv) -> dict[str, Any]:
    out = {f"ddp/{o}/{s}/{p}": run_case(env, "ddp", o, s, p) for o, s, p in CASES}
    for strategy, optimizer, _ in OTHERS:
        out[f"{strategy}/{optimizer}"] = run_case(env, strategy, optimizer, "constant", "fp16")
    return out


@pytest.mark.slow
def test_ddp_updates_do_not_sync():
    """Every case in one launch of 2 gloo ranks."""
    ranks = launch(_all_cases_on_two_ranks, world_size=2, timeout=300)
    for result in ranks:
        for case in (f"ddp/{o}/{s}/{p}" for o, s, p in CASES):
            assert result[case]["syncs"] == [[]] * UPDATES, case
            assert result[case]["last_epoch"] == UPDATES - case.endswith("fp16"), case
        for strategy, optimizer, cost in OTHERS:
            counts = [len(calls) for calls in result[f"{strategy}/{optimizer}"]["syncs"]]
            assert counts == [cost] * UPDATES, (strategy, optimizer, result[f"{strategy}/{optimizer}"]["syncs"])
