"""Logging set-up: rank 0 prints (through tqdm, so bars stay intact) and writes train.log."""
from __future__ import annotations

import logging
import os
import sys

from tqdm import tqdm


class _TqdmHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record))
        except Exception:  # pragma: no cover - logging must never kill a run
            self.handleError(record)


#: ANSI colours of the level names on a terminal (``training.colored_logs``)
COLOURS = {"DEBUG": "\033[36m", "INFO": "\033[32m", "WARNING": "\033[33m", "ERROR": "\033[31m",
           "CRITICAL": "\033[1;31m"}
RESET = "\033[0m"
FORMAT, DATE_FORMAT = "%(asctime)s | %(levelname)s | %(message)s", "%Y-%m-%dT%H:%M:%S"


class ColouredFormatter(logging.Formatter):
    """The level name in its colour; the record itself is left as it was (train.log stays plain)."""

    def format(self, record: logging.LogRecord) -> str:
        plain = record.levelname
        record.levelname = f"{COLOURS.get(plain, '')}{plain}{RESET}"
        try:
            return super().format(record)
        finally:
            record.levelname = plain


def setup_logging(save_dir: str | None, rank: int, colored: bool = False) -> logging.Logger:
    """Configure the ``mmvl`` logger once per run; non-main ranks only log warnings. ``colored``:
    colour the level names on the console when it is a terminal (never in train.log)."""
    logger = logging.getLogger("mmvl")
    for h in list(logger.handlers):
        logger.removeHandler(h)
        h.close()
    logger.propagate = False
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    fmt = logging.Formatter(FORMAT, DATE_FORMAT)
    console = _TqdmHandler()
    terminal = bool(getattr(sys.stdout, "isatty", lambda: False)())  # tqdm.write prints to stdout
    console.setFormatter(ColouredFormatter(FORMAT, DATE_FORMAT) if colored and terminal else fmt)
    logger.addHandler(console)
    if rank == 0 and save_dir:
        os.makedirs(save_dir, exist_ok=True)
        fh = logging.FileHandler(os.path.join(save_dir, "train.log"))
        fh.setFormatter(fmt)
        logger.addHandler(fh)
    return logger
