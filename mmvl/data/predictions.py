"""Writes ``<save_dir>/predictions/<dataset>_<split>.json|csv`` atomically (rank 0 only)."""
from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from typing import Any


def write_predictions(save_dir: str, dataset: str, split: str, rows: list[dict[str, Any]],
                      fmt: str = "json") -> str:
    """Write ``rows`` (a list of flat dicts) and return the file's path."""
    folder = os.path.join(save_dir, "predictions")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{dataset}_{split}.{fmt}")
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else ["id"])
        writer.writeheader()
        writer.writerows(rows)
        text = buf.getvalue()
    else:
        text = json.dumps(rows)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp_")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path
