"""An evaluation's progress: a bar on rank 0's terminal, else a log line a minute; then the throughput."""
from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("mmvl")
#: without a terminal, rank 0 logs progress this often
LOG_EVERY_S = 60.0


class Progress:
    """A tqdm bar on a terminal (rank 0), else a log line every :data:`LOG_EVERY_S`; then the throughput."""

    def __init__(self, what: str, total: int, batches: int, main: bool, enabled: bool):
        self.what, self.total, self.main, self.done = what, total, main, 0
        self.start = self.last_log = time.perf_counter()
        self.bar = None
        if main and enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=f"eval {what}", unit="sample", dynamic_ncols=True, leave=True,
                            file=sys.stderr)

    def update(self, n: int) -> None:
        n = min(n, self.total - self.done)
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.main and time.perf_counter() - self.last_log >= LOG_EVERY_S:
            self.last_log = time.perf_counter()
            log.info("%s: %d/%d samples (%.0f%%), %.0f samples/s", self.what, self.done, self.total,
                     100 * self.done / max(self.total, 1), self.done / max(self.last_log - self.start, 1e-9))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def log_done(self) -> None:
        if self.main:
            elapsed = time.perf_counter() - self.start
            log.info("%s: evaluated %d samples in %.1f s (%.0f samples/s)", self.what, self.total, elapsed,
                     self.total / max(elapsed, 1e-9))
