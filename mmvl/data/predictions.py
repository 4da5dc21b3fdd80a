"""Writes ``<save_dir>/predictions/<dataset>_<split>.json|csv`` row by row, atomically (rank 0 only).

Evaluation hands over each batch's rows as it goes, so predictions for a large split are
never all in memory; the file appears (renamed over any earlier one) only once complete.
"""
from __future__ import annotations

import contextlib
import csv
import json
import os
from typing import Any, Iterable

from mmvl.errors import UserError
from mmvl.io import atomic_open


class PredictionWriter:
    """``write(rows)`` any number of times, then ``close()`` (returns the path) or ``abort()``."""

    def __init__(self, save_dir: str, dataset: str, split: str, fmt: str = "json"):
        folder = os.path.join(save_dir, "predictions")
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, f"{dataset}_{split}.{fmt}")
        self.fmt, self.count = fmt, 0
        self._stack = contextlib.ExitStack()
        self._file = self._stack.enter_context(atomic_open(self.path, "w"))
        self._csv: csv.DictWriter | None = None

    def write(self, rows: Iterable[dict[str, Any]]) -> None:
        for row in rows:
            if self.fmt == "csv":
                if self._csv is None:
                    self._csv = csv.DictWriter(self._file, fieldnames=list(row))
                    self._csv.writeheader()
                self._csv.writerow(row)
            else:
                self._file.write(("[" if self.count == 0 else ", ") + json.dumps(row))
            self.count += 1

    def close(self) -> str:
        if self.fmt == "csv" and self._csv is None:
            csv.DictWriter(self._file, fieldnames=["id"]).writeheader()
        elif self.fmt != "csv":
            self._file.write("[]" if self.count == 0 else "]")
        self._stack.close()
        return self.path

    def abort(self) -> None:
        """Drop the partial file; an earlier complete file at ``path`` stays."""
        self._stack.__exit__(RuntimeError, RuntimeError("prediction writing aborted"), None)


def write_predictions(save_dir: str, dataset: str, split: str, rows: list[dict[str, Any]],
                      fmt: str = "json") -> str:
    """Write ``rows`` (a list of flat dicts) and return the file's path."""
    writer = PredictionWriter(save_dir, dataset, split, fmt)
    try:
        writer.write(rows)
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def check_prediction_targets(save_dir: str, datasets: Iterable[str], splits: Iterable[str]) -> None:
    """A UserError when a prediction file could not be written, found before any work (not after
    training or evaluating a whole split): a file where the ``predictions`` folder goes, or a
    folder where a prediction file goes."""
    folder = os.path.join(save_dir, "predictions")
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise UserError(f"{folder!r} is a file, and the predictions go into a folder of that name; move "
                        "the file, or choose another env.save_dir.")
    for name in datasets:
        for split in splits:
            for fmt in ("json", "csv"):
                target = os.path.join(folder, f"{name}_{split}.{fmt}")
                if os.path.isdir(target):
                    raise UserError(f"{target!r} is a folder, and the predictions are written to a file of that "
                                    "name; move the folder, or choose another env.save_dir.")
