"""What curves.png and TensorBoard cost a training run, as a share of its time.

Trains the demo config for ``--updates`` updates with both writers on, timing every call
into them (the picture is drawn at evaluations, the event files at log intervals), then
prints their cost against the same run's training time, and projects it onto the demo's
own schedule (2,000 updates, a log line every 100, an evaluation every 1,000)::

    python benchmarks/run_pictures.py --updates 200

Both run at log/evaluation time only, never inside the train step, so their share falls
as the intervals grow.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict

DEMO = "projects/visual_bert/configs/sort_of_clevr/defaults.yaml"


def _timed(cls, name: str, times: dict[str, list[float]]) -> None:
    original = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            times[f"{cls.__name__}.{name}"].append(time.perf_counter() - start)

    setattr(cls, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--updates", type=int, default=200)
    parser.add_argument("--log-interval", type=int, default=20)
    parser.add_argument("--evaluation-interval", type=int, default=100)
    args = parser.parse_args()

    import torch

    from mmvl import Trainer, load_config
    from mmvl.trainers.callbacks import CurvesCallback, TensorBoardCallback

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    times: dict[str, list[float]] = defaultdict(list)
    _timed(CurvesCallback, "draw", times)
    for hook in ("on_train_start", "on_log", "on_evaluation_end", "on_train_end"):
        _timed(TensorBoardCallback, hook, times)
    with tempfile.TemporaryDirectory() as save:
        trainer = Trainer(load_config([
            f"config={DEMO}", f"env.save_dir={save}", f"training.max_updates={args.updates}",
            f"training.log_interval={args.log_interval}", f"training.evaluation_interval={args.evaluation_interval}",
            f"training.checkpoint_interval={args.updates}", "training.progress_bar=false",
            "training.tensorboard=true", "training.curves=true"]))
        start = time.perf_counter()
        trainer.fit()
        total = time.perf_counter() - start
        events = [json.loads(line) for line in open(os.path.join(save, "metrics.jsonl"))]
    train = [e for e in events if e["split"] == "train"]
    s_per_update = statistics.median(e["s_per_update"] for e in train)
    draws = times["CurvesCallback.draw"]
    tb_log = times["TensorBoardCallback.on_log"]
    tb_rest = sum(sum(v) for k, v in times.items() if k.startswith("TensorBoard") and not k.endswith("on_log"))
    spent = sum(draws) + sum(tb_log) + tb_rest
    print(f"{args.updates} updates in {total:.1f} s ({s_per_update:.4f} s/update, median of the log windows)")
    print(f"curves.png: {len(draws)} drawings, {sum(draws):.2f} s (first {draws[0]:.2f} s with the matplotlib "
          f"import, then median {statistics.median(draws[1:] or draws):.2f} s)")
    print(f"tensorboard: {len(tb_log)} train events {sum(tb_log):.3f} s, evaluations/config/hparams {tb_rest:.2f} s")
    print(f"share of this run's time: {spent / total:.2%}")
    later = statistics.median(draws[1:] or draws)
    demo = 2000 * s_per_update
    demo_cost = draws[0] + later * 2 + statistics.median(tb_log) * 20 + tb_rest
    print(f"projected onto the demo's schedule (2 drawings, 20 log lines in {demo:.0f} s of training): "
          f"{demo_cost:.2f} s = {demo_cost / demo:.2%}; one later drawing = {later / s_per_update:.1f} updates")


if __name__ == "__main__":
    main()
