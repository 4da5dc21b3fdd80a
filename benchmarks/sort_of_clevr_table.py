#!/usr/bin/env python
"""Markdown rows of Sort-of-CLEVR results from finished runs (docs/sort_of_clevr.md's model-zoo and seed tables).

    python benchmarks/sort_of_clevr_table.py [--label NAME] SAVE_DIR [SAVE_DIR ...]
    python benchmarks/sort_of_clevr_table.py --header

Each SAVE_DIR is a run's env.save_dir: the last ``val`` event of its ``metrics.jsonl`` is the
held-out result (the final model, not a selected checkpoint), the parameters are counted in
``checkpoints/last.ckpt`` and the wall time is read from ``wall_s.txt`` (written by the
benchmark scripts around mmvl_run). Several SAVE_DIRs (seeds, thread counts) give one row
of means with the range (min-max) in brackets.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TYPES = ["shape", "left", "top", "closest", "furthest", "count"]
COLUMNS = ["accuracy", "accuracy/non_relational", "accuracy/relational", *(f"accuracy/{t}" for t in TYPES)]
HEADER = ("| model (config) | params | updates | wall time | runs | overall | non-rel. | relational | "
          + " | ".join(TYPES) + " | prior (overall / relational) |")


def last_val(save_dir: Path) -> dict:
    events = [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    val = [e for e in events if e.get("split") == "val"]
    if not val:
        raise SystemExit(f"{save_dir}: no val event in metrics.jsonl (did the run finish?)")
    return val[-1]


def parameters(save_dir: Path) -> int:
    from mmvl.io import safe_load

    state = safe_load(save_dir / "checkpoints" / "last.ckpt")["model"]
    return sum(v.numel() for v in state.values() if hasattr(v, "numel"))


def model_name(save_dir: Path) -> str:
    for line in (save_dir / "config.yaml").read_text().splitlines():
        if line.startswith("model:"):
            return line.split(":", 1)[1].strip()
    return "?"


def fmt(values: list[float], digits: int = 3) -> str:
    mean = sum(values) / len(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def minutes(seconds: list[float]) -> str:
    mean = sum(seconds) / len(seconds)
    text = f"{int(mean // 60)} min {int(mean % 60):02d} s"
    if len(seconds) > 1:
        text += f" ({min(seconds) / 60:.1f}-{max(seconds) / 60:.1f} min)"
    return text


def row(save_dirs: list[Path], label: str | None = None) -> str:
    events = [last_val(d) for d in save_dirs]
    walls = [float((d / "wall_s.txt").read_text().split()[0]) for d in save_dirs if (d / "wall_s.txt").is_file()]
    cells = [label or model_name(save_dirs[0]), f"{parameters(save_dirs[0]):,}",
             "/".join(sorted({str(e["update"]) for e in events})), minutes(walls) if walls else "-",
             str(len(events))]
    cells += [fmt([e[c] for e in events]) for c in COLUMNS]
    cells.append(f"{events[0]['accuracy/prior']:.3f} / {events[0]['accuracy/prior/relational']:.3f}")
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("save_dirs", nargs="*", type=Path)
    parser.add_argument("--label")
    parser.add_argument("--header", action="store_true")
    args = parser.parse_args(argv)
    if args.header:
        print(HEADER)
        print("|" + "---|" * HEADER.count(" | ") + "---|")
    if args.save_dirs:
        print(row(args.save_dirs, args.label))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
