"""usage: mmvl_plot SAVE_DIR [SAVE_DIR ...] [--metric DATASET/METRIC] [--out compare.png]

Draws several runs in one figure (smoothed train total_loss, and one validation metric
with each run's best point) and prints, for every run, the best and last value of each
validation metric and its wall time. Runs are labelled by the config keys that differ
between their config.yaml files (e.g. ``optimizer.params.lr=0.001``).

  --metric  DATASET/METRIC to draw, e.g. sort_of_clevr/accuracy or
            sort_of_clevr/accuracy/relational (default: the first run's
            training.early_stop.criteria, else its first dataset's first metric)
  --out     the PNG to write (default: compare.png)

Example:
  mmvl_run config=projects/visual_bert/configs/sort_of_clevr/defaults.yaml \\
      optimizer.params.lr=3e-4 env.save_dir=save/lr3e-4
  mmvl_plot save/visual_bert_sort_of_clevr save/lr3e-4 --metric sort_of_clevr/accuracy
"""
from __future__ import annotations

import argparse
import sys

from mmvl_cli.common import cli_main


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmvl_plot", description="Compare mmvl runs in one figure.")
    parser.add_argument("save_dirs", nargs="+", metavar="SAVE_DIR", help="env.save_dir of each run")
    parser.add_argument("--metric", default=None, help="DATASET/METRIC to draw (default: the early-stop criterion)")
    parser.add_argument("--out", default="compare.png", help="the PNG to write (default: compare.png)")
    return parser


def _plot(opts: list[str]) -> int:
    args = _parser().parse_args(opts)
    from mmvl.plots import draw_comparison
    from mmvl.runs import Run, format_table, run_labels

    runs = [Run(d) for d in args.save_dirs]
    labels = run_labels(runs)
    path, metric = draw_comparison(runs, labels, args.metric, args.out)
    print(format_table(runs, labels))
    print(f"\nwrote {path}" + (f" (val {metric})" if metric else " (no validation events to draw)"))
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli_main(_plot, sys.argv[1:] if argv is None else argv, __doc__ or "")


if __name__ == "__main__":
    sys.exit(main())
