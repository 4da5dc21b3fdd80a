"""The Engine: fp32/bf16/fp16 training, accumulation equivalence, state round trip, the device it
picks, and the same loop under ``python`` and ``torchrun``.

Loops move their data with the engine (``engine.to_device``), so they run on whatever device
``Engine()`` picks (CUDA on a GPU host); exact-equivalence checks pin ``device="cpu"``.
CUDA-only checks are marked ``cuda`` (skipped without a GPU).
"""
from __future__ import annotations

import copy

import pytest
import torch

from mmvl.engine import Engine


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                               torch.nn.Linear(16, 3))


def _data(n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _prepared(engine: Engine, **adam_w) -> tuple:
    """The model and an AdamW prepared by ``engine``, and the data on its device."""
    model = _model()
    model, opt = engine.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2, **adam_w))
    return (model, opt, *engine.to_device(_data()))


def _train(engine: Engine, micro: int, updates: int, clip: float | None = None) -> torch.nn.Module:
    model, opt, x, y = _prepared(engine)
    per = x.shape[0] // micro
    norms = []
    for _ in range(updates):
        for i in range(micro):
            with engine.accumulate(model):
                with engine.autocast():
                    out = model(x[i * per:(i + 1) * per])
                loss = torch.nn.functional.cross_entropy(out.float(), y[i * per:(i + 1) * per])
                engine.backward(loss)
                if clip:
                    n = engine.clip_grad_norm_(model, clip)
                    if n is not None:
                        norms.append(n)
                opt.step()
                opt.zero_grad()
    model.norms = norms
    return model


def test_accumulation_equals_full_batch():
    full = _train(Engine(gradient_accumulation=1, device="cpu"), micro=1, updates=5, clip=0.5)
    acc = _train(Engine(gradient_accumulation=4, device="cpu"), micro=4, updates=5, clip=0.5)
    for a, b in zip(full.parameters(), acc.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert len(acc.norms) == 5  # clipping happens only at boundaries
    torch.testing.assert_close(torch.stack(full.norms), torch.stack(acc.norms), atol=1e-6, rtol=0)


def test_accumulation_without_engine_boundary_differs():
    """Guard: stepping every micro-batch (no accumulation) gives different weights."""
    full = _train(Engine(gradient_accumulation=1, device="cpu"), micro=1, updates=5)
    wrong = _train(Engine(gradient_accumulation=1, device="cpu"), micro=4, updates=5)
    assert any(not torch.allclose(a, b) for a, b in zip(full.parameters(), wrong.parameters()))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_engine_trains_on_its_default_device(precision):
    engine = Engine(precision=precision)
    model, opt, x, y = _prepared(engine)
    losses = []
    for _ in range(30):
        with engine.accumulate(model), engine.autocast():
            out = model(x)
            assert out.dtype == torch.float32  # a prepared forward's outputs come back in fp32 (as Accelerate's)
        loss = torch.nn.functional.cross_entropy(out.float(), y)
        engine.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.7
    assert engine.scaler is None


def test_fp16_uses_scaler_and_unscales_before_clip():
    engine = Engine(precision="fp16")
    assert engine.scaler is not None
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = engine.prepare(model, opt)
    x, y = engine.to_device(_data())
    with engine.accumulate(model), engine.autocast():
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
    engine.backward(loss)
    norm = engine.clip_grad_norm_(model, 1e9)
    # the norm is of the true gradients, not the scaled ones
    ref = _model()
    torch.nn.functional.cross_entropy(ref(_data()[0]), _data()[1]).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    assert abs(norm.item() - ref_norm.item()) / ref_norm.item() < 0.05


def test_save_and_load_state_round_trip(tmp_path):
    engine = Engine()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model, opt, sched = engine.prepare(model, opt, sched)
    x, y = engine.to_device(_data())
    for _ in range(3):
        engine.backward(torch.nn.functional.cross_entropy(model(x), y))
        opt.step(); opt.zero_grad(); sched.step()
    engine.save_state(str(tmp_path / "state"))
    saved = copy.deepcopy(model.state_dict())
    expected = torch.rand(3)
    for p in model.parameters():
        p.data.add_(1.0)
    engine.load_state(str(tmp_path / "state"))
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, saved[k])
    assert sched.get_last_lr()[0] == pytest.approx(1e-2 / 4)
    assert torch.equal(torch.rand(3), expected)  # RNG restored to the saved point


def test_prepare_wraps_dataloader_and_moves_batches():
    engine = Engine()
    ds = torch.utils.data.TensorDataset(torch.randn(10, 2))
    loader = engine.prepare(torch.utils.data.DataLoader(ds, batch_size=4))
    batches = list(loader)
    assert len(batches) == 3 and batches[0][0].device == engine.device
    assert engine.unwrap_model(torch.nn.Linear(1, 1)) is not None
    assert engine.gather(torch.ones(2)).shape == (2,)


# -- which device and process group the Engine picks by itself ---------------------------------

def test_engine_takes_the_gpu_when_one_is_visible_and_device_pins_it(monkeypatch):
    from tests.fixtures.fake_cuda import FakeGPUs

    FakeGPUs(monkeypatch, count=2)
    assert Engine().device == torch.device("cuda", 0)
    assert Engine(device="cpu").device == torch.device("cpu")
    assert Engine(device="cuda:1").device == torch.device("cuda", 1)


def test_engine_under_torchrun_joins_the_group_on_its_own_gpu(monkeypatch):
    """Rank 1 of a torchrun job: the Engine joins the group (NCCL) and takes GPU 1 (set_device), so its
    object collectives and barriers do not land on GPU 0."""
    import torch.distributed as dist

    from tests.fixtures.fake_cuda import FakeGPUs

    gpus = FakeGPUs(monkeypatch, count=2)
    for var, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(var, value)
    joined = []
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: joined.append(kw))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    engine = Engine()
    assert (engine.rank, engine.world_size, engine.device) == (1, 2, torch.device("cuda", 1))
    assert gpus.set_calls == [1] and gpus.current == 1
    assert [(j["backend"], j["rank"], j["world_size"]) for j in joined] == [("nccl", 1, 2)]


def test_env_and_device_together_are_refused():
    from mmvl.distributed.env import DistEnv
    from mmvl.errors import UserError

    with pytest.raises(UserError, match="pass one"):
        Engine(env=DistEnv(), device="cpu")


@pytest.mark.parametrize("prefetch", [True, False])
def test_prepared_loader_prefetches_on_a_side_stream_unless_told_not_to(monkeypatch, prefetch):
    """``training.prefetch`` (or ``Engine(prefetch=...)``): on CUDA the next batch is copied on a side
    stream; with prefetch off each batch is copied when it is needed, on the compute stream."""
    from omegaconf import OmegaConf

    import mmvl.engine.prepared as engine_module
    from mmvl.engine import DeviceLoader
    from tests.fixtures.fake_cuda import StreamRecorder

    engine = Engine(OmegaConf.create({"training": {"prefetch": prefetch}}), device="cpu")
    assert engine.prefetch is prefetch and Engine(device="cpu", prefetch=False).prefetch is False
    rec = StreamRecorder().install(monkeypatch)
    monkeypatch.setattr(engine_module, "to_device", rec.to_device)
    loader = DeviceLoader([{"x": torch.tensor(i)} for i in range(3)], torch.device("cuda"), engine.prefetch)
    for _ in range(2):  # every pass starts from the first batch, as a DataLoader does
        assert [b["x"].item() for b in loader] == [0, 1, 2]
    if prefetch:
        assert rec.log[:4] == ["copy0:side:async", "wait", "copy1:side:async", "wait"]
    else:
        assert rec.log[:3] == ["copy0:compute:async", "copy1:compute:async", "copy2:compute:async"]


def _torchrun(script: str, *args: str, nproc: int = 2, timeout: float = 240):
    import subprocess
    import sys

    from tests.fixtures.faults import child_env, communicate, free_port

    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--monitor-interval=0.2",
            script, *args]
    popen = subprocess.Popen(argv, env=child_env(CUDA_VISIBLE_DEVICES=""), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    result = communicate(popen, timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_the_same_loop_under_torchrun_equals_one_process(tmp_path):
    """The plain loop script, unchanged: 2 gloo processes under torchrun (the Engine joins the group
    itself) end with the weights of the one-process run over the same global batches."""
    import os

    from mmvl.checkpoint.schema import ENGINE_STATE
    from mmvl.io import safe_load
    from tests.fixtures import engine_loop_script

    engine_loop_script.main(str(tmp_path / "one.ckpt"), device="cpu")
    result = _torchrun(os.path.abspath(engine_loop_script.__file__), str(tmp_path / "two.ckpt"))
    assert "world_size=2 backend=gloo" in result.stdout
    one, two = (safe_load(str(tmp_path / name / ENGINE_STATE)) for name in ("one.ckpt", "two.ckpt"))
    assert len(two["rng"]) == 2 and len(one["rng"]) == 1
    assert one["model"].keys() == two["model"].keys()
    for key, value in one["model"].items():
        torch.testing.assert_close(two["model"][key], value, atol=1e-6, rtol=0, msg=key)
    assert not torch.equal(one["model"]["0.weight"], _trained_nothing()["0.weight"])


def _trained_nothing() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    torch.randn(64, 16)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 2)).state_dict()


@pytest.mark.slow
def test_example_engine_loop_runs_under_python_and_torchrun():
    import os
    import subprocess
    import sys

    from tests.fixtures.faults import child_env

    example = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "engine_loop.py")
    alone = subprocess.run([sys.executable, example], env=child_env(CUDA_VISIBLE_DEVICES=""),
                           capture_output=True, text=True, timeout=240)
    assert alone.returncode == 0, alone.stderr[-3000:]
    both = _torchrun(os.path.abspath(example))
    for out in (alone.stdout, both.stdout):
        assert float(out.split("train accuracy after 50 updates:")[1]) > 0.9, out


# -- on a GPU (pytest -m cuda) ----------------------------------------------------------------------

def _step(engine: Engine, model, opt, x, y, scale_loss: float = 1.0) -> torch.Tensor:
    with engine.accumulate(model):
        with engine.autocast():
            out = model(x)
        loss = torch.nn.functional.cross_entropy(out.float(), y)
        engine.backward(loss * scale_loss)
        opt.step()
        opt.zero_grad()
    return out


@pytest.mark.cuda
@pytest.mark.parametrize("precision,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_engine_trains_in_half_precision_on_cuda(precision, dtype):
    engine = Engine(precision=precision, device="cuda")
    assert engine.device.type == "cuda" and (engine.scaler is not None) is (precision == "fp16")
    model, opt, x, y = _prepared(engine)
    losses = []
    for _ in range(40):
        out = _step(engine, model, opt, x, y)
        assert out.dtype == dtype and out.is_cuda
        losses.append(torch.nn.functional.cross_entropy(out.float(), y).item())
    assert losses[-1] < losses[0] * 0.7
    assert all(p.dtype == torch.float32 for p in model.parameters())  # autocast: fp32 master weights


@pytest.mark.cuda
@pytest.mark.parametrize("fused", [False, True])
def test_fp16_grad_scaler_skips_an_update_with_inf_gradients(fused):
    engine = Engine(precision="fp16", device="cuda")
    model, opt, x, y = _prepared(engine, fused=fused)
    _step(engine, model, opt, x, y)
    while opt.state_dict()["state"] == {}:  # the first steps may be skipped while the scale settles
        _step(engine, model, opt, x, y)
    scale = engine.scaler.get_scale()
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    moments = {k: v["exp_avg"].clone() for k, v in opt.state_dict()["state"].items()}
    _step(engine, model, opt, x, y, scale_loss=float("inf"))
    assert engine.scaler.get_scale() == scale * engine.scaler.get_backoff_factor()
    for k, v in model.state_dict().items():
        assert torch.equal(v, params[k]), k
    for k, v in opt.state_dict()["state"].items():
        assert torch.equal(v["exp_avg"], moments[k]), k
    _step(engine, model, opt, x, y)  # and training goes on
    assert any(not torch.equal(v, params[k]) for k, v in model.state_dict().items())


@pytest.mark.cuda
def test_save_and_load_state_round_trip_on_cuda(tmp_path):
    """Model, fused AdamW, grad scaler, schedule and every RNG (the GPU's too) come back on the GPU."""
    engine = Engine(precision="fp16", device="cuda")
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model, opt, sched = engine.prepare(model, opt, sched)
    x, y = engine.to_device(_data())
    for _ in range(4):
        _step(engine, model, opt, x, y)
        sched.step()
    engine.save_state(str(tmp_path / "state"))
    expected_gpu, expected_cpu = torch.rand(5, device="cuda"), torch.rand(5)
    saved = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    scale, lr = engine.scaler.get_scale(), sched.get_last_lr()[0]
    for _ in range(2):
        _step(engine, model, opt, x, y)
        sched.step()
    engine.load_state(str(tmp_path / "state"))
    for k, v in model.state_dict().items():
        assert v.is_cuda and torch.equal(v, saved[k]), k
    for k, v in opt.state_dict()["state"].items():
        for name, value in v.items():
            assert value.device == saved_opt["state"][k][name].device and torch.equal(value, saved_opt["state"][k][name])
    assert engine.scaler.get_scale() == scale and sched.get_last_lr()[0] == lr
    assert torch.equal(torch.rand(5, device="cuda"), expected_gpu) and torch.equal(torch.rand(5), expected_cpu)
