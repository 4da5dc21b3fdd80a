"""What the interleaved speed benchmarks share: the time of ``n`` updates, with the device drained
before and after (a CUDA step is asynchronous; a CPU one is not)."""
from __future__ import annotations

import time
from typing import Any

import torch


def drained() -> None:
    """Wait for the device's queued work (a CUDA step is asynchronous; a CPU one is not)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(step: Any, n: int) -> float:
    """Seconds per update of ``step.run(n)``."""
    drained()
    start = time.perf_counter()
    step.run(n)
    drained()
    return (time.perf_counter() - start) / n
