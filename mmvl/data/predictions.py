"""Writes ``<save_dir>/predictions/<dataset>_<split>.json|csv`` atomically (rank 0 only)."""
from __future__ import annotations

import csv
import io
import json
import os
from typing import Any

from mmvl.checkpoint import atomic_write


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
    atomic_write(path, "w", lambda f: f.write(text))
    return path
