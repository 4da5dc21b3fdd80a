"""The Engine on CPU: fp32 and bf16 training, accumulation equivalence, state round trip."""
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


def _train(engine: Engine, micro: int, updates: int, clip: float | None = None) -> torch.nn.Module:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = engine.prepare(model, opt)
    x, y = _data()
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
    full = _train(Engine(gradient_accumulation=1), micro=1, updates=5, clip=0.5)
    acc = _train(Engine(gradient_accumulation=4), micro=4, updates=5, clip=0.5)
    for a, b in zip(full.parameters(), acc.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert len(acc.norms) == 5  # clipping happens only at boundaries
    torch.testing.assert_close(torch.stack(full.norms), torch.stack(acc.norms), atol=1e-6, rtol=0)


def test_accumulation_without_engine_boundary_differs():
    """Guard: stepping every micro-batch (no accumulation) gives different weights."""
    full = _train(Engine(gradient_accumulation=1), micro=1, updates=5)
    wrong = _train(Engine(gradient_accumulation=1), micro=4, updates=5)
    assert any(not torch.allclose(a, b) for a, b in zip(full.parameters(), wrong.parameters()))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_engine_trains_on_cpu(precision):
    engine = Engine(precision=precision)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = engine.prepare(model, opt)
    x, y = _data()
    losses = []
    for _ in range(30):
        with engine.accumulate(model), engine.autocast():
            out = model(x)
            if precision == "bf16":
                assert out.dtype == torch.bfloat16
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
    x, y = _data()
    with engine.accumulate(model), engine.autocast():
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
    engine.backward(loss)
    norm = engine.clip_grad_norm_(model, 1e9)
    # the norm is of the true gradients, not the scaled ones
    ref = _model()
    torch.nn.functional.cross_entropy(ref(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    assert abs(norm.item() - ref_norm.item()) / ref_norm.item() < 0.05


def test_save_and_load_state_round_trip(tmp_path):
    engine = Engine()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model, opt, sched = engine.prepare(model, opt, sched)
    x, y = _data()
    for _ in range(3):
        engine.backward(torch.nn.functional.cross_entropy(model(x), y))
        opt.step(); opt.zero_grad(); sched.step()
    engine.save_state(str(tmp_path / "state.ckpt"))
    saved = copy.deepcopy(model.state_dict())
    expected = torch.rand(3)
    for p in model.parameters():
        p.data.add_(1.0)
    engine.load_state(str(tmp_path / "state.ckpt"))
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
