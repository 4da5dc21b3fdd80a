"""mmvl Trainer vs a plain PyTorch loop: same model, same data, same process.

    python benchmarks/trainer_overhead.py [--updates 200] [--repeats 3] [key=value ...]

Both sides build the model, data and optimizer from the same config (the
Sort-of-CLEVR demo by default) and run the same number of updates: forward,
loss, backward, clipping, AdamW step and LR schedule. The mmvl side runs the
full Trainer (callbacks, logging every log_interval, progress bar); the
timer covers the updates only (no dataset generation, final checkpoint or
evaluation). Runs alternate plain/mmvl ``--repeats`` times and the median
of each side is compared. Prints the step-time ratio mmvl/plain.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(ROOT, "projects/visual_bert/configs/sort_of_clevr/defaults.yaml")


def _config(opts: list[str], save_dir: str, updates: int):
    from mmvl.config import load_config

    return load_config([f"config={DEFAULT_CONFIG}", f"env.save_dir={save_dir}",
                        "run_type=train", f"training.max_updates={updates}",
                        "training.checkpoint_interval=0", "training.evaluation_interval=0",
                        "training.num_workers=0", *opts])


def plain_loop(config) -> float:
    """The loop a researcher would write by hand; returns seconds for all updates."""
    from mmvl.build import build_datasets, build_model, model_config
    from mmvl.losses import build_losses, compute_losses
    from mmvl.optim import build_optimizer, build_scheduler
    from mmvl.utils.rng import seed_all

    seed_all(int(config.training.seed))
    builder = next(iter(build_datasets(config).values()))
    builder.prepare()
    model = build_model(config, {"d": builder})
    losses = build_losses(list(model_config(config, {"d": builder}).losses))
    optimizer = build_optimizer(model, config)
    updates = int(config.training.max_updates)
    scheduler = build_scheduler(optimizer, config, max_updates=updates)
    loader = torch.utils.data.DataLoader(
        builder.build("train"), batch_size=int(config.training.batch_size), shuffle=True,
        drop_last=True, collate_fn=builder.collate,
        generator=torch.Generator().manual_seed(int(config.training.seed)))
    clip = config.training.clip_grad_norm
    model.train()
    done, start = 0, time.perf_counter()
    while done < updates:
        for batch in loader:
            out = model(batch)
            loss = sum(compute_losses(losses, batch, out).values())
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            done += 1
            if done == updates:
                break
    return time.perf_counter() - start


def mmvl_trainer(config) -> float:
    from mmvl.trainers import Trainer
    from mmvl.trainers.callbacks import Callback

    trainer = Trainer(config)
    marks: dict[str, float] = {}

    class Clock(Callback):
        def on_train_start(self) -> None:
            marks["start"] = time.perf_counter()

        def on_update_end(self, info) -> None:
            marks["end"] = time.perf_counter()

    trainer.callbacks.insert(0, Clock(trainer))
    trainer.fit()
    return marks["end"] - marks["start"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    args, opts = parser.parse_known_args()
    torch.set_num_threads(int(os.environ.get("MMVL_BENCH_THREADS", "2")))
    import mmvl  # noqa: F401

    times: dict[str, list[float]] = {"plain": [], "mmvl": []}
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = os.environ.get("MMVL_DATA_DIR", os.path.join(ROOT, "data"))
        for r in range(args.repeats):
            for side, fn in (("plain", plain_loop), ("mmvl", mmvl_trainer)):
                cfg = _config(opts + [f"env.data_dir={data_dir}"], os.path.join(tmp, f"{side}{r}"),
                              args.updates)
                seconds = fn(cfg)
                times[side].append(seconds / args.updates)
                print(f"repeat {r} {side:5s}: {1000 * seconds / args.updates:.2f} ms/update",
                      file=sys.stderr)
    plain, ours = statistics.median(times["plain"]), statistics.median(times["mmvl"])
    print(f"plain PyTorch loop: {1000 * plain:.2f} ms/update (median of {args.repeats})")
    print(f"mmvl Trainer:       {1000 * ours:.2f} ms/update (median of {args.repeats})")
    print(f"step-time ratio mmvl/plain: {ours / plain:.3f} ({100 * (ours / plain - 1):+.1f}% per step)")


if __name__ == "__main__":
    main()
