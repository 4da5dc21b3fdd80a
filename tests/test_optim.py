"""Optimizer grouping, LR scaling, name fallback, and scheduler curves."""
import importlib
import logging
import math

import pytest
import torch
from omegaconf import OmegaConf

from mmvl.errors import UserError
from mmvl import optim
from mmvl.optim import (base_lr, build_optimizer, build_scheduler, optimizer_section, param_groups,
                        scheduler_section)


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.lin = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.gn = torch.nn.GroupNorm(2, 4)
        self.frozen = torch.nn.Linear(4, 1)
        self.frozen.requires_grad_(False)


def _cfg(optimizer, scheduler=None, batch_size=32, max_updates=100):
    return OmegaConf.create({"optimizer": optimizer, "scheduler": scheduler,
                             "training": {"batch_size": batch_size, "max_updates": max_updates}})


def _opt(model, optimizer, device=None, batch_size=32):
    """``build_optimizer`` over the typed section of a config whose optimizer is ``optimizer``."""
    return build_optimizer(model, optimizer_section(_cfg(optimizer)), device, batch_size=batch_size)


def test_param_groups_decay_only_weight_matrices():
    model = Tiny()
    opt = _opt(model, {"type": "adam_w", "params": {"lr": 1e-3, "weight_decay": 0.1}})
    assert isinstance(opt, torch.optim.AdamW)
    groups = {g["group"]: g for g in opt.param_groups}
    ids = lambda ps: {id(p) for p in ps}  # noqa: E731
    assert ids(groups["decay"]["params"]) == ids([model.emb.weight, model.lin.weight])
    assert ids(groups["no_decay"]["params"]) == ids([model.lin.bias, model.norm.weight, model.norm.bias,
                                                     model.gn.weight, model.gn.bias])
    assert groups["decay"]["weight_decay"] == 0.1 and groups["no_decay"]["weight_decay"] == 0.0
    # without weight_decay in params the decay group keeps the optimizer's default (AdamW: 0.01)
    opt = _opt(model, {"type": "adam_w", "params": {"lr": 1e-3}})
    assert {g["group"]: g["weight_decay"] for g in opt.param_groups} == {"decay": 0.01, "no_decay": 0.0}


def test_model_hook_overrides_grouping():
    model = Tiny()
    model.get_optimizer_parameters = lambda config: [{"params": model.lin.parameters(), "lr": 0.5}]
    opt = _opt(model, {"type": "sgd", "params": {"lr": 0.1}})
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["lr"] == 0.5


@pytest.mark.parametrize("scaling,expected", [(None, 1e-3), ("linear", 1e-3 * 512 / 256),
                                              ("sqrt", 1e-3 * math.sqrt(2))])
def test_lr_scaling(scaling, expected):
    opt = _opt(Tiny(), {"type": "adam_w", "params": {"lr": 1e-3}, "lr_scaling": scaling}, batch_size=512)
    assert all(g["lr"] == pytest.approx(expected) for g in opt.param_groups)


def test_lr_scaling_unknown_is_user_error():
    with pytest.raises(UserError, match="linear"):
        _opt(Tiny(), {"type": "adam_w", "params": {"lr": 1e-3}, "lr_scaling": "linaer"})


@pytest.mark.parametrize("name", ["SGD", "sgd", "Adam", "rmsprop"])
def test_torch_optimizer_fallback(name):
    opt = _opt(Tiny(), {"type": name, "params": {"lr": 0.01}})
    assert type(opt).__name__.lower() == name.lower()


def test_unknown_optimizer_and_bad_params_name_the_key():
    with pytest.raises(UserError, match="adam_w"):
        _opt(Tiny(), {"type": "adamm_w", "params": {"lr": 0.01}})
    with pytest.raises(UserError, match=r"optimizer\.params\.lrr.*Did you mean 'lr'"):
        _opt(Tiny(), {"type": "adam_w", "params": {"lrr": 0.01}})
    with pytest.raises(UserError, match=r"optimizer\.params\.lr=-1"):
        _opt(Tiny(), {"type": "adam_w", "params": {"lr": -1.0}})
    with pytest.raises(UserError, match=r"optimizer\.params\.betas"):
        _opt(Tiny(), {"type": "adam_w", "params": {"lr": 0.1, "betas": [1.5, 0.9]}})
    with pytest.raises(UserError, match="optimizer.type"):
        _opt(Tiny(), None)


def _lrs(scheduler, optimizer, steps):
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def _sched(type_, params, max_updates=100):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return opt, build_scheduler(opt, scheduler_section(_cfg({"type": "sgd"}, {"type": type_, "params": params})),
                                max_updates=max_updates)


def test_warmup_linear_curve():
    opt, s = _sched("warmup_linear", {"num_warmup_steps": 4, "num_training_steps": 12})
    lrs = _lrs(s, opt, 14)
    assert lrs[:5] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    assert lrs[8] == pytest.approx(0.5) and lrs[12] == pytest.approx(0.0) and lrs[13] == pytest.approx(0.0)
    opt, s = _sched("warmup_linear", {"num_warmup_steps": 0, "num_training_steps": 10, "min_lr_ratio": 0.1})
    lrs = _lrs(s, opt, 12)
    assert lrs[0] == pytest.approx(1.0) and lrs[5] == pytest.approx(0.1 + 0.9 * 0.5) and lrs[11] == pytest.approx(0.1)


def test_warmup_cosine_curve_and_max_updates_default():
    opt, s = _sched("warmup_cosine", {"num_warmup_steps": 2, "min_lr_ratio": 0.2}, max_updates=10)
    lrs = _lrs(s, opt, 11)
    assert lrs[1] == pytest.approx(0.5) and lrs[2] == pytest.approx(1.0)
    assert lrs[6] == pytest.approx(0.2 + 0.8 * 0.5)  # halfway through the 8 decay steps
    assert lrs[10] == pytest.approx(0.2)


def test_constant_and_null_scheduler():
    opt, s = _sched("constant", {"num_warmup_steps": 2})
    assert _lrs(s, opt, 4) == pytest.approx([0.0, 0.5, 1.0, 1.0])
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    assert build_scheduler(opt, scheduler_section(_cfg({"type": "sgd"}, None))) is None


def test_scheduler_state_dict_round_trip(tmp_path):
    opt, s = _sched("warmup_cosine", {"num_warmup_steps": 3, "num_training_steps": 20})
    _lrs(s, opt, 7)
    torch.save({"scheduler": s.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "s.pt")
    state = torch.load(tmp_path / "s.pt", weights_only=True)
    opt2, s2 = _sched("warmup_cosine", {"num_warmup_steps": 3, "num_training_steps": 20})
    opt2.load_state_dict(state["optimizer"])
    s2.load_state_dict(state["scheduler"])
    assert _lrs(s2, opt2, 5) == pytest.approx(_lrs(s, opt, 5))


def test_scheduler_bad_params():
    with pytest.raises(UserError, match="num_warmup_steps=50 exceeds"):
        _sched("warmup_linear", {"num_warmup_steps": 50, "num_training_steps": 10})
    with pytest.raises(UserError, match=r"scheduler\.params\.num_warmup_step\b.*num_warmup_steps"):
        _sched("warmup_linear", {"num_warmup_step": 5})
    with pytest.raises(UserError, match="num_warmup_steps"):
        _sched("warmup_linear", {})
    with pytest.raises(UserError, match="warmup_cosine"):
        _sched("warmup_cosin", {})
    with pytest.raises(UserError, match="min_lr_ratio"):
        _sched("warmup_cosine", {"num_warmup_steps": 1, "min_lr_ratio": 2})


def test_param_groups_drop_empty_groups():
    assert [g["group"] for g in param_groups(torch.nn.LayerNorm(3), 0.1)] == ["no_decay"]
    with pytest.raises(UserError, match="no trainable"):
        _opt(torch.nn.Linear(2, 2).requires_grad_(False), {"type": "sgd", "params": {"lr": 0.1}})


def test_scheduler_takes_trainer_max_updates():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    cfg = OmegaConf.create({"scheduler": {"type": "warmup_linear",
                                          "params": {"num_warmup_steps": 0, "num_training_steps": None}},
                            "training": {"max_updates": None}})
    with pytest.raises(UserError, match="max_updates"):
        build_scheduler(opt, scheduler_section(cfg))
    s = build_scheduler(opt, scheduler_section(cfg), max_updates=4)
    assert _lrs(s, opt, 5) == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])


class WithMultipliers(Tiny):
    def lr_multipliers(self):
        return {"lin": 0.5, "emb": 0.1}


def test_lr_multipliers_by_parameter_prefix_also_through_a_wrapper():
    class Wrapper(torch.nn.Module):  # what DDP / DataParallel look like from outside
        def __init__(self, module):
            super().__init__()
            self.module = module

    model = WithMultipliers()
    cfg = _cfg({"type": "adam_w", "params": {"lr": 1e-3, "weight_decay": 0.1}})
    for wrapped in (model, Wrapper(model)):
        opt = build_optimizer(wrapped, optimizer_section(cfg))
        lr_of = {id(p): (g["lr"], g["weight_decay"]) for g in opt.param_groups for p in g["params"]}
        assert lr_of[id(model.emb.weight)] == (pytest.approx(1e-4), 0.1)
        assert lr_of[id(model.lin.weight)] == (pytest.approx(5e-4), 0.1)
        assert lr_of[id(model.lin.bias)] == (pytest.approx(5e-4), 0.0)
        assert lr_of[id(model.norm.weight)] == (pytest.approx(1e-3), 0.0)
        assert base_lr(opt) == pytest.approx(1e-3)  # what the logs show: the new layers' lr
    with pytest.raises(UserError, match="optimizer.params.lr"):
        _opt(model, {"type": "adam_w", "params": {"weight_decay": 0.1}})


@pytest.mark.parametrize("type_,device,params,want", [
    ("adam_w", "cuda", {}, True),              # the default on CUDA
    ("adam_w", torch.device("cuda", 1), {}, True),
    ("adam", "cuda", {}, True),
    ("sgd", "cuda", {}, True),
    ("adam_w", "cpu", {}, True),               # and on the CPU (torch >= 2.4 has the kernels)
    ("sgd", "cpu", {"momentum": 0.9}, True),
    ("adam_w", "cuda", {"fused": False}, False),  # optimizer.params.fused overrides
    ("adam_w", "cpu", {"foreach": True}, False),  # so does picking foreach (fused+foreach is an error)
    ("adam_w", "cpu", {"differentiable": True}, False),  # fused has no differentiable step
    ("adam_w", None, {}, False),               # no device: torch's own default
])
def test_registered_optimizers_are_fused_by_default(type_, device, params, want):
    # the model is still on the CPU when the optimizer is built (prepare moves it later)
    opt = _opt(Tiny(), {"type": type_, "params": {"lr": 1e-3, **params}}, device=device)
    assert bool(opt.defaults["fused"]) is want


def test_a_device_without_fused_kernels_gets_foreach_logged_once(monkeypatch, caplog):
    torch_optimizer = importlib.import_module("torch.optim.optimizer")  # not an attribute of torch.optim
    monkeypatch.setattr(torch_optimizer, "_get_fused_kernels_supported_devices", lambda: ["cuda"])
    monkeypatch.setattr(optim.optimizers, "_fallback_logged", set())
    with caplog.at_level(logging.INFO, logger="mmvl"):
        first = _opt(Tiny(), {"type": "adam_w", "params": {"lr": 1e-3}}, device="cpu")
        second = _opt(Tiny(), {"type": "sgd", "params": {"lr": 1e-3}}, device="cpu")
    assert not first.defaults["fused"] and first.defaults["foreach"] and second.defaults["foreach"]
    said = [r.getMessage() for r in caplog.records if "no fused" in r.getMessage()]
    assert len(said) == 1 and "foreach" in said[0] and "sync" in said[0]


def test_other_optimizers_get_no_fused_default():
    opt = _opt(Tiny(), {"type": "rmsprop", "params": {"lr": 1e-3}}, device="cuda")
    assert not opt.defaults.get("fused")


def test_a_loaded_state_keeps_the_built_implementation():
    """A checkpoint saved unfused (an older run) loads into a fused optimizer that stays fused, so
    the fp16 scaler, which hands fused optimizers its scale, still steps it."""
    model = Tiny()
    opt = _opt(model, {"type": "adam_w", "params": {"lr": 1e-3}}, device="cpu")
    saved = _opt(model, {"type": "adam_w", "params": {"lr": 1e-3, "fused": False}}).state_dict()
    kept = optim.implementation_of(opt)
    opt.load_state_dict(saved)
    optim.restore_implementation(opt, kept)
    assert all(g["fused"] is True and not g["foreach"] for g in opt.param_groups)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model.lin(torch.ones(3, 4)).sum()).backward()
    scaler.step(opt)  # an unfused group would refuse the scale here
    scaler.update()


@pytest.mark.cuda
def test_fused_adam_w_steps_on_cuda_and_under_the_grad_scaler():
    model = Tiny()
    opt = _opt(model, {"type": "adam_w", "params": {"lr": 1e-2}}, device="cuda")
    model.cuda()
    scaler = torch.amp.GradScaler("cuda")
    before = model.lin.weight.detach().clone()
    scaler.scale(model.lin(torch.ones(3, 4, device="cuda")).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert opt.defaults["fused"] is True and not torch.equal(model.lin.weight, before)


def test_warmup_longer_than_the_run_is_clamped_with_a_warning(caplog):
    """A smoke test (training.max_updates=5) with the shipped 1000-update warm-up runs; the lr rises
    over the whole run. An explicit num_training_steps below the warm-up stays an error (above)."""
    with caplog.at_level(logging.WARNING, logger="mmvl"):
        opt, s = _sched("warmup_linear", {"num_warmup_steps": 1000}, max_updates=5)
    assert _lrs(s, opt, 6) == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "num_warmup_steps=1000 is longer than this run (5 updates)" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mmvl"):
        _sched("warmup_cosine", {"num_warmup_steps": 5}, max_updates=5)  # exactly the run: no warning
    assert not caplog.records


def test_short_run_with_the_shipped_warmup_trains(tmp_path, capsys):
    from mmvl_cli.run import main
    from tests.fixtures.toy import register, toy_opts

    register()
    opts = toy_opts(tmp_path, "training.max_updates=6", "scheduler.params.num_warmup_steps=1000")
    assert main(opts) == 0
    log = (tmp_path / "save" / "train.log").read_text()
    assert log.count("warm-up clamped to 6") == 1 and "update 6/6" in log


def test_a_models_own_groups_lose_their_frozen_parameters():
    """Frozen tensors hold no optimizer state, also when the model groups its parameters itself."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    model[0].requires_grad_(False)
    model.get_optimizer_parameters = lambda config: [{"params": model[0].parameters(), "lr": 0.5},
                                                     {"params": model[1].parameters()}]
    optimizer = _opt(model, {"type": "sgd", "params": {"lr": 0.1}})
    assert [len(g["params"]) for g in optimizer.param_groups] == [2]
    assert {id(p) for p in optimizer.param_groups[0]["params"]} == {id(p) for p in model[1].parameters()}
