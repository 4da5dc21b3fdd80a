"""FLOPs, tokens and model FLOPs utilisation (MFU), shared by the Trainer's log line and benchmarks.

MFU = achieved model FLOP/s / the hardware's peak FLOP/s. The FLOPs of one training
update (forward + backward) are counted once, by ``torch.utils.flop_counter``, and divided
by the samples it processed; the peak comes from a small table of known GPUs (dense
tensor-core figures, the vendor's data sheets) or from the user.

The Trainer counts on a side pass (:func:`leaves_no_trace`), not on a real update: a real
update under ``FlopCounterMode`` runs eager (Dynamo skips frames while a dispatch mode is
active), so the first compiled update would come one update late and the counted one would
differ from the others.
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
        self.total: int | None = None  # None: not counted yet

    @property
    def pending(self) -> bool:
        """Not counted yet (a caller that never wants a count sets ``total`` to 0)."""
        return self.total is None

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Adds the FLOPs run inside to :attr:`total` (several micro-batches add up to one update)."""
        from torch.utils.flop_counter import FlopCounterMode

        mode = FlopCounterMode(display=False)
        with mode:
            yield
        self.total = (self.total or 0) + int(mode.get_total_flops())


@contextlib.contextmanager
def leaves_no_trace(module: torch.nn.Module, device: torch.device | str | None = None) -> Iterator[None]:
    """Run a forward and backward of ``module`` on its own weights as if it never happened.

    Restored on exit: the CPU generator and ``device``'s (dropout draws), every buffer's
    value and object (BatchNorm running statistics, ``num_batches_tracked``) and every
    parameter's ``.grad`` (set to None inside, so a backward accumulates into tensors that are
    then dropped; the gradients the next update starts from are the ones it had). The weights
    are used in place, not copied: a forward never writes them and the pass needs no extra
    memory for them, and the arithmetic is the same kernels on the same values as the real update.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    grads = [(p, p.grad) for p in module.parameters()]
    for p, _ in grads:
        p.grad = None
    buffers = [(name, b, b.detach().clone()) for name, b in module.named_buffers()]
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        with torch.no_grad():
            for name, original, saved in buffers:
                owner, _, leaf = name.rpartition(".")
                holder = module.get_submodule(owner)
                if getattr(holder, leaf) is not original:  # a forward that rebinds instead of updating
                    setattr(holder, leaf, original)
                original.copy_(saved)
        for p, grad in grads:
            p.grad = grad


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
