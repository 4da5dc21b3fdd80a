"""``training.group_by_length`` against shuffled batches: the positions a batch pads and the time of
an update, the same VLM and data, one process.

    python benchmarks/group_by_length.py                        # easy-VQA conversations, the shipped config
    python benchmarks/group_by_length.py --updates 2 --rounds 1 --smoke   # a smoke run (tiny model)
    python benchmarks/group_by_length.py training.batch_size=16          # key=value pairs: as mmvl_run's

Two Trainers are built from ``projects/vlm/configs/easy_vqa_conversations/defaults.yaml`` (pip install
mmvl[easy_vqa]), one with ``training.group_by_length=false`` and one with ``true``; the same seed
gives both the same initial weights. Each round times ``--updates`` calls of ``Trainer.train_step``
of each (the one that goes first alternates) after an untimed one. Printed: the sequence positions an
update computes per sample (padding included) for each, and ``ratio`` is the median over rounds of
the grouped update's time over the shuffled one's (below 1: grouping saves that share).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.timing import timed  # noqa: E402  (the tree first on sys.path)

CONFIG = os.path.join(ROOT, "projects", "vlm", "configs", "easy_vqa_conversations", "defaults.yaml")
#: a model small enough that a smoke run takes seconds (the data stays easy-VQA's)
SMOKE = ["model_config.vlm.language_model.random.hidden_size=32",
         "model_config.vlm.language_model.random.intermediate_size=64",
         "model_config.vlm.language_model.random.num_hidden_layers=1"]


class Steps:
    """``run(n)``: ``n`` updates of one Trainer, counting the positions and samples they computed."""

    def __init__(self, trainer: Any):
        self.trainer, self.positions, self.samples = trainer, 0, 0

    def run(self, n: int) -> None:
        for _ in range(n):
            info = self.trainer.train_step()
            self.positions += int(info["tokens"])
            self.samples += int(info["samples"])


def build(grouped: bool, args: argparse.Namespace, save_dir: str) -> Steps:
    from mmvl.config import load_config
    from mmvl.trainers import Trainer

    opts = [f"config={CONFIG}", "run_type=train", f"training.batch_size={args.batch}",
            f"training.group_by_length={str(grouped).lower()}", f"env.save_dir={save_dir}",
            "training.progress_bar=false", "training.tensorboard=false", "training.curves=false",
            *(SMOKE if args.smoke else []), *args.opts]
    return Steps(Trainer(load_config(opts)))


def trainer_arguments(doc: str, updates: int) -> argparse.ArgumentParser:
    """The options of the benchmarks that time ``Trainer.train_step`` of a shipped config, side by side."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--updates", type=int, default=updates, help="timed updates per round and side")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model (checks the script, not the speed)")
    parser.add_argument("opts", nargs="*", help="key=value pairs applied last, as on mmvl_run's command line")
    return parser


def parsed(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The options, torch's threads set and mmvl's built-ins registered."""
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import mmvl  # noqa: F401  (registers the built-ins)

    return args


def main() -> int:
    args = parsed(trainer_arguments(__doc__, updates=20))

    with tempfile.TemporaryDirectory() as tmp:
        sides = {"shuffled": build(False, args, os.path.join(tmp, "shuffled")),
                 "grouped": build(True, args, os.path.join(tmp, "grouped"))}
        for steps in sides.values():
            steps.run(1)  # untimed: first-call work
            steps.positions = steps.samples = 0
        times: dict[str, list[float]] = {name: [] for name in sides}
        for r in range(args.rounds):
            names = list(sides) if r % 2 == 0 else list(reversed(sides))
            for name in names:
                times[name].append(timed(sides[name], args.updates))
        for name, steps in sides.items():
            print(f"{name}: {1e3 * statistics.median(times[name]):.1f} ms/update, "
                  f"{steps.positions / max(1, steps.samples):.1f} positions/sample")
        ratios = [g / s for g, s in zip(times["grouped"], times["shuffled"])]
        print(f"ratio grouped/shuffled: {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
