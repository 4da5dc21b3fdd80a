"""FLOP counting and MFU arithmetic on a model whose FLOPs are counted by hand."""
from __future__ import annotations

import pytest
import torch

from mmvl.utils import flops
from mmvl.utils.flops import batch_tokens, count_flops, leaves_no_trace, mfu, peak_flops


def test_linear_stack_flops_match_the_hand_count():
    torch.manual_seed(0)
    widths, batch = [8, 32, 16, 4], 5
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16),
                                torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(batch, 8)
    forward = sum(2 * batch * a * b for a, b in zip(widths, widths[1:]))
    # backward: a weight gradient for every layer, an input gradient for all but the first
    backward = forward + sum(2 * batch * a * b for a, b in zip(widths[1:], widths[2:]))
    assert count_flops(lambda: model(x)) == forward == 2 * 5 * (8 * 32 + 32 * 16 + 16 * 4)
    assert count_flops(lambda: model(x).sum().backward()) == forward + backward

    per_sample = (forward + backward) / batch
    # 1000 samples/s on a device of 2 GFLOP/s: per_sample * 1000 / 2e9
    assert mfu(per_sample, 1000.0, 2e9) == pytest.approx(per_sample * 1000 / 2e9)
    assert mfu(per_sample, 1000.0, 2e9, devices=4) == pytest.approx(per_sample * 1000 / 8e9)
    assert mfu(per_sample, 1000.0, None) is None and mfu(None, 1000.0, 2e9) is None


def test_peak_table_and_override(monkeypatch):
    assert peak_flops("cpu", "bf16") is None
    assert peak_flops("cpu", "bf16", override_tflops=100) == 100e12
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, precision, want in (("NVIDIA H200", "bf16", 989.4), ("NVIDIA H100 PCIe", "bf16", 756.0),
                                  ("NVIDIA A100-SXM4-80GB", "fp32", 19.5), ("NVIDIA L40S", "bf16", 362.1),
                                  ("Tesla V100-SXM2-16GB", "bf16", None), ("Some Future GPU", "bf16", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        got = peak_flops("cuda", precision)
        assert (got is None) if want is None else got == pytest.approx(want * 1e12), name
    assert list(flops.PEAK_TFLOPS).index("H100 PCIe") < list(flops.PEAK_TFLOPS).index("H100")


def test_batch_tokens_counts_text_and_regions_from_shapes():
    batch = {"input_ids": torch.zeros(4, 9, dtype=torch.long), "features": torch.zeros(4, 36, 2048)}
    assert batch_tokens(batch) == 4 * 9 + 4 * 36
    assert batch_tokens({"image": torch.zeros(2, 3, 8, 8)}) == 0


class _Rebinds(torch.nn.Module):
    """A forward that rebinds its buffer (``self.seen = ...``) instead of updating it in place."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = self.seen + 1
        return x


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_side_pass_leaves_rng_buffers_and_gradients_as_they_were(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5),
                                _Rebinds(), torch.nn.Linear(8, 2)).to(device).train()
    x = torch.randn(4, 6, device=device)
    model(x).sum().backward()  # gradients an update would be accumulating into
    grads = {n: (p.grad, p.grad.clone()) for n, p in model.named_parameters()}
    buffers = {n: (b, b.clone()) for n, b in model.named_buffers()}
    rng = torch.get_rng_state(), torch.cuda.get_rng_state() if device == "cuda" else None
    with leaves_no_trace(model, device):
        model(x).sum().backward()
        assert all(p.grad is not None and p.grad is not grads[n][0] for n, p in model.named_parameters())
        assert int(model[3].seen) == 2 and model[1].num_batches_tracked == 2  # the pass did move them
    assert torch.equal(torch.get_rng_state(), rng[0])
    if device == "cuda":
        assert torch.equal(torch.cuda.get_rng_state(), rng[1])
    for n, p in model.named_parameters():
        assert p.grad is grads[n][0] and torch.equal(p.grad, grads[n][1]), n
    for n, b in model.named_buffers():
        assert b is buffers[n][0] and torch.equal(b, buffers[n][1]), n
