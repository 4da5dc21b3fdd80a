"""Logging set-up: rank 0 prints (through tqdm, so bars stay intact) and writes train.log."""
from __future__ import annotations

import logging
import os

from tqdm import tqdm


class _TqdmHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record))
        except Exception:  # pragma: no cover - logging must never kill a run
            self.handleError(record)


def setup_logging(save_dir: str | None, rank: int) -> logging.Logger:
    """Configure the ``mmvl`` logger once per run; non-main ranks only log warnings."""
    logger = logging.getLogger("mmvl")
    for h in list(logger.handlers):
        logger.removeHandler(h)
        h.close()
    logger.propagate = False
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    fmt = logging.Formatter("%(asctime)s | %(levelname)s | %(message)s", "%Y-%m-%dT%H:%M:%S")
    console = _TqdmHandler()
    console.setFormatter(fmt)
    logger.addHandler(console)
    if rank == 0 and save_dir:
        os.makedirs(save_dir, exist_ok=True)
        fh = logging.FileHandler(os.path.join(save_dir, "train.log"))
        fh.setFormatter(fmt)
        logger.addHandler(fh)
    return logger
