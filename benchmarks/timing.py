"""What the interleaved speed benchmarks share: the time of ``n`` updates, with the device drained
before and after (a CUDA step is asynchronous; a CPU one is not)."""
from __future__ import annotations

import time
from typing import Any

import torch


def timed(step: Any, n: int) -> float:
    """Seconds per update of ``step.run(n)``."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    step.run(n)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / n
