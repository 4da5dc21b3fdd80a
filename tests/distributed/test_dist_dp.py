"""``dp`` (DataParallel): which GPUs it uses, the losses a replicated model returns, and the autocast
dtype inside the replicas. DataParallel needs GPUs to run; these run torch's own DataParallel code
paths on a CPU host wherever they do not launch a kernel (``pytest -m cuda`` covers the rest)."""
from __future__ import annotations

import contextlib
import importlib
import threading

import pytest
import torch
from omegaconf import OmegaConf

from mmvl.distributed.env import DistEnv
from mmvl.distributed.strategies import build_strategy
from mmvl.distributed.strategies.dp import MMVLDataParallel, dp_device_ids, mean_replica_losses
from mmvl.errors import UserError
from mmvl.losses import compute_losses
from tests.fixtures.fake_cuda import FakeGPUs


@pytest.fixture
def four_gpus(monkeypatch):
    gpus = FakeGPUs(monkeypatch, count=4)
    # the only GPU query DataParallel's constructor makes (memory and core counts, for a warning)
    monkeypatch.setattr(importlib.import_module("torch.nn.parallel.data_parallel"), "_check_balance",
                        lambda device_ids: None)
    return gpus


@pytest.mark.parametrize("device,ids", [("cuda:0", [0, 1, 2, 3]), ("cuda:2", [2, 0, 1, 3]), ("cuda", [0, 1, 2, 3])])
def test_device_ids_start_at_the_configured_gpu(four_gpus, device, ids):
    """``training.device=cuda:2``: the model sits on GPU 2, so DataParallel must scatter from it."""
    strategy = build_strategy(OmegaConf.create({"distributed": {"strategy": "dp"}}),
                              DistEnv(device=torch.device(device)))
    model, _ = strategy.wrap(torch.nn.Linear(2, 2), None)
    assert isinstance(model, MMVLDataParallel) and dp_device_ids(torch.device(device), 4) == ids
    # what DataParallel itself derived: forward checks the module is on src_device_obj
    first = torch.device(device).index or 0
    assert model.device_ids == ids and model.output_device == first
    assert model.src_device_obj == torch.device("cuda", first)
    assert strategy.unwrap(model) is model.module


def test_one_gpu_or_cpu_leaves_the_model_alone(monkeypatch):
    FakeGPUs(monkeypatch, count=1)
    strategy = build_strategy(OmegaConf.create({"distributed": {"strategy": "dp"}}),
                              DistEnv(device=torch.device("cuda", 0)))
    module = torch.nn.Linear(2, 2)
    assert strategy.wrap(module, None)[0] is module


def _replica_output() -> dict:
    """One replica's output; meta tensors, as torch's Gather refuses CPU ones (and runs no kernel)."""
    return {"scores": torch.empty(3, 5, device="meta"), "losses": {"mlm": torch.empty((), device="meta")}}


@pytest.fixture
def gather_on_meta(monkeypatch):
    """torch's DataParallel gather (scatter_gather.gather -> Gather.forward) with its one GPU call,
    ``comm.gather``, done by ``torch.cat``: the shapes are DataParallel's own."""
    monkeypatch.setattr(torch.nn.parallel._functions.comm, "gather",
                        lambda tensors, dim, destination: torch.cat(tensors, dim))
    dp = MMVLDataParallel(torch.nn.Identity())  # no GPU: DataParallel keeps the module as it is
    dp.dim = 0  # what its constructor sets when there are GPUs
    return dp


def test_a_gathered_model_loss_is_a_scalar_the_losses_accept(gather_on_meta):
    outputs = [_replica_output(), _replica_output()]
    with pytest.warns(UserWarning, match="all input tensors were scalars"):
        plain = torch.nn.DataParallel.gather(gather_on_meta, outputs, "cpu")
    assert plain["losses"]["mlm"].shape == (2,)  # the defect: one value per replica
    with pytest.raises(UserError, match="must be a scalar tensor"):
        compute_losses([], {}, plain)
    gathered = gather_on_meta.gather(outputs, "cpu")
    assert gathered["scores"].shape == (6, 5) and gathered["losses"]["mlm"].shape == ()
    assert compute_losses([], {}, gathered)["mlm"].shape == ()


def test_replica_losses_are_averaged():
    out = mean_replica_losses({"scores": torch.ones(4, 2), "losses": {"mlm": torch.tensor([1.0, 3.0]),
                                                                       "itm": torch.tensor(0.5)}}, 2)
    assert out["losses"]["mlm"].item() == 2.0 and out["losses"]["itm"].item() == 0.5
    assert torch.equal(out["scores"], torch.ones(4, 2))
    plain = {"scores": torch.ones(2)}
    assert mean_replica_losses(plain, 2) is plain


class _Probe(torch.nn.Module):
    """Records the autocast state its forward sees, and the dtype a matmul computes in."""

    def __init__(self, seen: list):
        super().__init__()
        self.seen = seen
        self.weight = torch.nn.Parameter(torch.ones(4, 4))

    def forward(self, x):
        self.seen.append((threading.current_thread() is threading.main_thread(),
                          torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), (x @ self.weight).dtype))
        return x


@pytest.fixture
def accelerator_on_cpu(monkeypatch):
    """torch's parallel_apply (one thread per replica) with its accelerator calls made no-ops, and the
    CPU as the device type, so the real threading code runs here."""
    if not hasattr(torch, "accelerator") or not hasattr(torch.accelerator, "device_index"):
        pytest.skip("this torch's parallel_apply does not go through torch.accelerator")
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cpu"))
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(torch.accelerator, "device_index", lambda *a, **k: contextlib.nullcontext())


@pytest.mark.parametrize("cls,inherits", [(torch.nn.DataParallel, False), (MMVLDataParallel, True)])
def test_replicas_compute_in_the_callers_autocast_dtype(accelerator_on_cpu, cls, inherits):
    """Autocast's dtype is thread-local: replica threads start from the default (bf16 for the CPU
    here, fp16 for CUDA). mmvl's DataParallel carries the caller's dtype into each replica."""
    seen: list = []
    dp = cls(torch.nn.Identity())
    dp.src_device_obj, dp.device_ids = torch.device("cpu"), [0, 1]
    replicas = [_Probe(seen), _Probe(seen)]
    inputs = [(torch.ones(2, 4),), (torch.ones(2, 4),)]
    with torch.autocast("cpu", dtype=torch.float16):
        dp.parallel_apply(replicas, inputs, [{}, {}])
    assert len(seen) == 2 and not any(main for main, *_ in seen)  # really in other threads
    if inherits:
        assert [s[1:] for s in seen] == [(True, torch.float16, torch.float16)] * 2
    else:
        assert all(s[1:3] != (True, torch.float16) for s in seen)  # the defect, reproduced


class _LossModel(torch.nn.Module):
    """Returns its own loss (as the VisualBERT pretraining head does) and records its compute dtype."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.dtypes: list = []

    def forward(self, x):
        out = self.linear(x)
        self.dtypes.append(out.dtype)
        return {"scores": out, "losses": {"mse": out.float().pow(2).mean()}}


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DataParallel needs at least 2 GPUs")
def test_dp_on_gpus_from_cuda_1_in_bf16_with_model_losses():
    from mmvl.engine import Engine

    last = torch.cuda.device_count() - 1
    engine = Engine(OmegaConf.create({"distributed": {"strategy": "dp"}}), precision="bf16", device=f"cuda:{last}")
    model = engine.prepare(_LossModel())
    assert isinstance(model, MMVLDataParallel) and model.device_ids[0] == last
    recorded = model.module.dtypes  # replicas share the module's list
    with engine.autocast():
        output = model(torch.randn(4 * torch.cuda.device_count(), 8, device=engine.device))
    losses = compute_losses([], {}, output)
    assert losses["mse"].shape == () and losses["mse"].device == engine.device
    assert len(recorded) == torch.cuda.device_count() and set(recorded) == {torch.bfloat16}
    losses["mse"].backward()
    assert model.module.linear.weight.grad.device == engine.device
