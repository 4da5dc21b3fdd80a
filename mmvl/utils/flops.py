"""FLOPs, tokens and model FLOPs utilisation (MFU), shared by the Trainer's log line and benchmarks.

MFU = achieved model FLOP/s / the hardware's peak FLOP/s. The FLOPs of one training
update (forward + backward) are counted once, by ``torch.utils.flop_counter`` on a real
update, and divided by the samples it processed; the peak comes from a small table of
known GPUs (dense tensor-core figures, the vendor's data sheets) or from the user.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

#: dense peak TFLOP/s by precision; the first name found in the device's name wins
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.2},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0},
    "H100": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},
    "H200": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},
    "H800": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},
    "B200": {"bf16": 2250.0, "fp16": 2250.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "A800": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.1, "fp16": 362.1, "fp32": 91.6},
    "L40": {"bf16": 181.0, "fp16": 181.0, "fp32": 90.5},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "fp32": 31.2},
    "V100": {"fp16": 125.0, "fp32": 15.7},
}


def peak_flops(device: torch.device | str, precision: str = "bf16",
               override_tflops: float | None = None) -> float | None:
    """Peak FLOP/s of ``device`` at ``precision`` (fp32 | fp16 | bf16), or None when unknown.

    ``override_tflops`` (e.g. ``training.peak_tflops``) wins. CPUs have no entry.
    """
    if override_tflops:
        return float(override_tflops) * 1e12
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, table in PEAK_TFLOPS.items():
        if key in name:
            value = table.get(precision)
            return None if value is None else value * 1e12
    return None


def mfu(flops_per_sample: float | None, samples_per_s: float, peak: float | None,
        devices: int = 1) -> float | None:
    """Model FLOPs utilisation in [0, 1] over ``devices`` equal devices (None when unknown)."""
    if not flops_per_sample or not peak:
        return None
    return flops_per_sample * samples_per_s / (peak * devices)


class FlopCount:
    """Counts the FLOPs of the torch operations run inside ``with counter.counting():``.

    Forward and backward of eager and compiled code are both seen; operations without
    a FLOP formula (elementwise, optimizer updates) count 0, so the result is the matmul
    and convolution work that MFU conventionally measures.
    """

    def __init__(self) -> None:
        self.total: int | None = None

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        from torch.utils.flop_counter import FlopCounterMode

        mode = FlopCounterMode(display=False)
        with mode:
            yield
        self.total = int(mode.get_total_flops())

    def once(self) -> contextlib.AbstractContextManager:
        """``counting()`` the first time, a no-op afterwards."""
        return self.counting() if self.total is None else contextlib.nullcontext()


def count_flops(fn: Any, *args: Any, **kwargs: Any) -> int:
    """FLOPs of ``fn(*args, **kwargs)`` (include ``.backward()`` in ``fn`` to count training)."""
    counter = FlopCount()
    with counter.counting():
        fn(*args, **kwargs)
    return int(counter.total or 0)


def batch_tokens(batch: Any) -> int:
    """Sequence positions in a batch, from shapes only (no device read): text tokens
    (``input_ids``, padded as computed) plus region features (``features``: B x M x F)."""
    if not isinstance(batch, dict):
        return 0
    tokens = 0
    ids = batch.get("input_ids")
    if isinstance(ids, torch.Tensor):
        tokens += ids.numel()
    feats = batch.get("features")
    if isinstance(feats, torch.Tensor) and feats.dim() == 3:
        tokens += feats.shape[0] * feats.shape[1]
    return tokens
