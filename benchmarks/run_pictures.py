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

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    "projects/visual_bert/configs/sort_of_clevr/defaults.yaml")


def _timed(owner, name: str, times: dict[str, list[float]], cpu: dict[str, float]) -> None:
    """Wrap ``owner.name`` to record its wall time per call and add its CPU time to ``cpu``."""
    original = getattr(owner, name)
    key = f"{getattr(owner, '__name__', owner)}.{name}"

    def wrapper(*args, **kwargs):
        start, start_cpu = time.perf_counter(), time.process_time()
        try:
            return original(*args, **kwargs)
        finally:
            times[key].append(time.perf_counter() - start)
            cpu[key] = cpu.get(key, 0.0) + time.process_time() - start_cpu

    setattr(owner, name, wrapper)  # on a class it becomes a method again (self is in args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--updates", type=int, default=200)
    parser.add_argument("--log-interval", type=int, default=20)
    parser.add_argument("--evaluation-interval", type=int, default=100)
    args = parser.parse_args()

    import torch

    import mmvl.plots
    from mmvl import Trainer, load_config
    from mmvl.trainers.callbacks import TensorBoardCallback

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    times: dict[str, list[float]] = defaultdict(list)
    cpu: dict[str, float] = {}
    _timed(mmvl.plots, "draw_run", times, cpu)  # what the curves callback calls when there is news
    for hook in ("on_train_start", "on_log", "on_evaluation_end", "on_train_end"):
        _timed(TensorBoardCallback, hook, times, cpu)
    with tempfile.TemporaryDirectory() as save:
        trainer = Trainer(load_config([
            f"config={DEMO}", f"env.save_dir={save}", f"training.max_updates={args.updates}",
            f"training.log_interval={args.log_interval}", f"training.evaluation_interval={args.evaluation_interval}",
            f"training.checkpoint_interval={args.updates}", "training.progress_bar=false",
            "training.tensorboard=true", "training.curves=true"]))
        start, start_cpu = time.perf_counter(), time.process_time()
        trainer.fit()
        total, total_cpu = time.perf_counter() - start, time.process_time() - start_cpu
        events = [json.loads(line) for line in open(os.path.join(save, "metrics.jsonl"))]
    train = [e for e in events if e["split"] == "train"]
    s_per_update = statistics.median(e["s_per_update"] for e in train)
    draws = times["mmvl.plots.draw_run"]
    tb_log = times["TensorBoardCallback.on_log"]
    tb_rest = sum(sum(v) for k, v in times.items() if k.startswith("TensorBoard") and not k.endswith("on_log"))
    spent = sum(draws) + sum(tb_log) + tb_rest
    print(f"{args.updates} updates in {total:.1f} s ({s_per_update:.4f} s/update, median of the log windows)")
    print(f"curves.png: {len(draws)} drawings, {sum(draws):.2f} s (first {draws[0]:.2f} s with the matplotlib "
          f"import, then median {statistics.median(draws[1:] or draws):.2f} s)")
    print(f"tensorboard: {len(tb_log)} train events {sum(tb_log):.3f} s, evaluations/config/hparams {tb_rest:.2f} s")
    print(f"share of this run's time: {spent / total:.2%} of the wall time, "
          f"{sum(cpu.values()) / total_cpu:.2%} of the CPU time ({sum(cpu.values()):.2f} of {total_cpu:.1f} s)")
    later = statistics.median(draws[1:] or draws)
    demo = 2000 * s_per_update
    demo_cost = draws[0] + later * 2 + statistics.median(tb_log) * 20 + tb_rest
    print(f"projected onto the demo's schedule (2 drawings, 20 log lines in {demo:.0f} s of training): "
          f"{demo_cost:.2f} s = {demo_cost / demo:.2%}; one later drawing = {later / s_per_update:.1f} updates")


if __name__ == "__main__":
    main()
