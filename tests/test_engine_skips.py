"""fp16 skipped updates without waiting for the device: the scaler's verdict stays a device flag,
and the LR schedule takes back the steps of skipped updates when it settles."""
from __future__ import annotations

import pytest
import torch

from mmvl.distributed.env import DistEnv
from mmvl.engine import Engine


def _setup(scheduler: str):
    engine = Engine(precision="fp16", env=DistEnv())  # CPU: torch's GradScaler works there too
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    if scheduler == "lambda":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    else:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return (engine, *engine.prepare(model, opt, sched))


def _update(engine, model, opt, sched, poison: bool) -> None:
    with engine.accumulate(model), engine.autocast():
        loss = model(torch.ones(3, 4)).float().sum()
    engine.backward(loss * (float("inf") if poison else 1e-3))  # 1e-3: below fp16's max at the initial scale
    opt.step()
    opt.zero_grad()
    sched.step()


@pytest.mark.parametrize("scheduler", ["lambda", "step"])
def test_skipped_updates_do_not_advance_the_schedule(scheduler):
    engine, model, opt, sched = _setup(scheduler)
    for poison in (False, True, True, False):
        _update(engine, model, opt, sched, poison)
        assert isinstance(opt.skipped, torch.Tensor) and opt.skipped.dtype == torch.bool
        assert opt.step_was_skipped == poison
    sched.settle()
    # 2 real updates: the schedule is where two steps put it, lr included
    assert sched.last_epoch == 2
    want = 1.0 / 3 if scheduler == "lambda" else 0.25
    assert opt.param_groups[0]["lr"] == pytest.approx(want)
    assert engine.state_dict()["scheduler"]["last_epoch"] == 2


def test_lambda_schedule_steps_ahead_until_settled_and_state_dict_settles():
    engine, model, opt, sched = _setup("lambda")
    _update(engine, model, opt, sched, poison=True)
    assert sched.last_epoch == 1  # stepped without reading the flag ...
    state = engine.state_dict()  # ... and taken back before it is saved
    assert state["scheduler"]["last_epoch"] == 0 and sched.last_epoch == 0
    assert opt.param_groups[0]["lr"] == pytest.approx(1.0)


def test_fp32_has_no_skip_flag():
    engine = Engine(env=DistEnv())
    model = torch.nn.Linear(4, 2)
    opt = engine.prepare(torch.optim.SGD(model.parameters(), lr=1.0))
    engine.backward(model(torch.ones(1, 4)).sum())
    opt.step()
    assert opt.skipped is None and opt.step_was_skipped is False


def _fused_update(monkeypatch, clip: bool):
    """One fp16 update of a fused AdamW; what the scaler's gradient pass and the step were given."""
    engine = Engine(precision="fp16", env=DistEnv())
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    model, opt = engine.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    inv_scales, step_scales = [], []
    check = torch._amp_foreach_non_finite_check_and_unscale_
    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_",
                        lambda grads, found_inf, inv_scale: (inv_scales.append(inv_scale.clone()),
                                                             check(grads, found_inf, inv_scale))[1])
    step = opt.optimizer.step
    monkeypatch.setattr(opt.optimizer, "step",
                        lambda *a, **k: (step_scales.append(getattr(opt.optimizer, "grad_scale", None)),
                                         step(*a, **k))[1])
    with engine.accumulate(model), engine.autocast():
        loss = model(torch.ones(3, 4)).float().sum()
    engine.backward(loss * 1e-3)
    if clip:
        engine.clip_grad_norm_(model, 1e6)  # large: nothing is clipped, the update must be the same
    opt.step()
    return inv_scales, step_scales, model.weight.detach()


def test_without_clipping_the_fused_step_unscales_in_its_kernel(monkeypatch):
    """One pass over the gradients either way: with clipping it unscales them (1/scale) and the step
    gets no scale; without, the scaler only checks them (x1) and the fused kernel unscales."""
    inv, steps, plain = _fused_update(monkeypatch, clip=False)
    assert [float(i) for i in inv] == [1.0] and len(steps) == 1 and float(steps[0]) == 2.0 ** 16
    inv, steps, clipped = _fused_update(monkeypatch, clip=True)
    assert [float(i) for i in inv] == [2.0 ** -16] and steps == [None]
    torch.testing.assert_close(plain, clipped)
