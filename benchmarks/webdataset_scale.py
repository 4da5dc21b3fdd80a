"""WebDataset shards against an image folder: samples/s through the DataLoader, and peak memory at
1x and 10x the shard count (bounded streaming: the same peak expected).

Generates ``--samples`` small PNG images with captions, writes them as shards of
``--per-shard`` samples (1x), and writes ``--scale`` times as many samples as ``--scale`` times
as many shards of the same size (10x). Three measurements, each in a fresh interpreter so each
peak is its own: one epoch of ``image_text_shards`` (the training stream, its DataLoader workers
and shuffle buffer) over the 1x and the 10x shards, and one epoch of the 1x samples read as an
image folder (a plain map-style Dataset opening the same PNG files, with the same image and text
processors and collate, shuffled, the same batch size and workers). Peak memory is the maximum
resident set of the main process and of its largest DataLoader worker while the epoch runs
(polled from ``/proc``; a forked worker's counts the pages it shares with the main process), and
that worker's private memory (what it holds itself: its shuffle buffer, decoded images, batches).
samples/s is timed from the first batch on (worker start-up excluded, for both). The last
line gives the ratios against the baselines measured in the same run: shards' samples/s over the
folder's, and the 10x peaks over the 1x peaks.

    python benchmarks/webdataset_scale.py                          # about a minute on 2 cores
    python benchmarks/webdataset_scale.py --samples 2000 --workers 4
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

WORDS = ["red", "green", "blue", "yellow", "grey", "pink", "square", "round", "a", "picture", "of", "number"]


def generate(root: Path, n: int, size: int) -> tuple[Path, Path]:
    """``n`` PNG images (``images/<k>.png``) and their ``captions.jsonl``; returns both paths."""
    import numpy as np
    from PIL import Image

    images, rng = root / "images", np.random.default_rng(0)
    images.mkdir(parents=True, exist_ok=True)
    captions = root / "captions.jsonl"
    with open(captions, "w", encoding="utf-8") as f:
        for k in range(n):
            pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(images / f"{k:07d}.png")
            text = f"a picture of a {WORDS[k % 6]} {WORDS[6 + k % 2]} number {k % 50}"
            f.write(json.dumps({"image": f"{k:07d}.png", "caption": text}) + "\n")
    return images, captions


def builder(data: Path, pattern: str, vocab: Path, image_size: int, buffer: int):
    from omegaconf import OmegaConf

    import mmvl.data.datasets  # noqa: F401  (registers image_text_shards)
    from mmvl.registry import DATASETS

    cfg = OmegaConf.load(Path(__file__).resolve().parents[1] / "configs/datasets/image_text_shards.yaml")
    cfg = OmegaConf.merge(cfg, {"dataset_config": {"image_text_shards": {
        "image_size": image_size, "shuffle_buffer": buffer, "splits": {"train": {"shards": pattern}},
        "processors": {"text_processor": {"params": {"tokenizer_path": str(vocab), "max_seq_length": 16}}}}}})
    return DATASETS.get("image_text_shards")(cfg.dataset_config.image_text_shards, str(data))


class FolderPairs:
    """The image-folder baseline: each item opens its PNG, with the shard dataset's processors."""

    def __init__(self, images: Path, captions: Path, b):
        self.rows = [json.loads(line) for line in captions.read_text(encoding="utf-8").splitlines() if line]
        self.images, self.text, self.pixels = images, b.text_processor, b.image_processor

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        from PIL import Image

        with Image.open(self.images / self.rows[i]["image"]) as img:
            image = self.pixels(img.convert("RGB"))
        return {"id": i, "image": image, "targets": 1, **self.text(self.rows[i]["caption"])}


def memory_mb(pid: int | str = "self") -> tuple[float, float]:
    """``(resident, private)`` MB of a process now (private: the pages no other process shares)."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if rest.strip().endswith("kB"):
                fields[name] = int(rest.split()[0])
    return fields["Rss"] / 1024, (fields["Private_Clean"] + fields["Private_Dirty"]) / 1024


class PeakMemory:
    """Polls the main process and its DataLoader workers every ``every`` s while an epoch runs."""

    def __init__(self, every: float = 0.02):
        import threading

        self.every, self.main, self.worker, self.worker_private = every, 0.0, 0.0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _children(self) -> list[str]:
        pids = []
        for task in Path("/proc/self/task").iterdir():
            try:
                pids += (task / "children").read_text().split()
            except OSError:
                pass
        return pids

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.main = max(self.main, memory_mb()[0])
            for pid in self._children():
                try:
                    rss, private = memory_mb(pid)
                except (OSError, KeyError):
                    continue  # a worker that just ended
                self.worker, self.worker_private = max(self.worker, rss), max(self.worker_private, private)
            self._stop.wait(self.every)

    def __enter__(self) -> "PeakMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def measure(args: argparse.Namespace) -> None:
    """One measurement (run in its own interpreter); prints one JSON line."""
    import torch
    from torch.utils.data import DataLoader

    from mmvl.data.shard_stream import train_stream

    data = Path(args.data)
    b = builder(data, args.pattern, data / "vocab.txt", args.image_size, args.buffer)
    if args.measure == "folder":
        dataset = FolderPairs(data / "images", data / "captions.jsonl", b)
        loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True, collate_fn=b.collate,
                            num_workers=args.workers, generator=torch.Generator().manual_seed(0))
        batches = iter(loader)
    else:
        stream = train_stream(b.build("train"), batch_size=args.batch_size, collate_fn=b.collate, seed=0, rank=0,
                              world_size=1, num_workers=args.workers)
        batches = (next(stream) for _ in range(stream.batches_per_epoch))
    before = memory_mb()[0]
    with PeakMemory() as peak:
        seen = len(next(batches)["id"])  # the clock starts once the workers are up and the first batch is in
        start = time.perf_counter()
        timed = sum(len(batch["id"]) for batch in batches)
        seconds = time.perf_counter() - start
    print(json.dumps({"samples": seen + timed, "timed": timed, "seconds": seconds, "before_mb": before,
                      "main_peak_mb": peak.main, "worker_peak_mb": peak.worker,
                      "worker_private_peak_mb": peak.worker_private}))


def run_measurement(args: argparse.Namespace, what: str, data: Path, pattern: str) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--measure", what, "--data", str(data),
               "--pattern", pattern, "--workers", str(args.workers), "--batch-size", str(args.batch_size),
               "--image-size", str(args.image_size), "--buffer", str(args.buffer)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"webdataset_scale: the {what} measurement failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=500, help="samples at 1x (10x holds --scale times as many)")
    p.add_argument("--per-shard", type=int, default=50)
    p.add_argument("--scale", type=int, default=10)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--buffer", type=int, default=100, help="shuffle_buffer, per worker")
    p.add_argument("--work-dir", default=None, help="where the data goes (default: a temporary folder)")
    p.add_argument("--measure", choices=["folder", "shards"], help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--pattern", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.measure:
        return measure(args)

    from mmvl.data.processors.text import write_word_vocab
    from mmvl.data.shard_writer import write_shards

    with tempfile.TemporaryDirectory(prefix="webdataset_scale_", dir=args.work_dir) as tmp:
        results, shards = {}, {}
        for name, n in (("1x", args.samples), (f"{args.scale}x", args.samples * args.scale)):
            data = Path(tmp) / name
            images, captions = generate(data, n, args.image_size)
            write_word_vocab(WORDS + [str(k) for k in range(50)], data / "vocab.txt")
            paths = write_shards(images, captions, data / "shards", samples_per_shard=args.per_shard)
            shards[name] = len(paths)
            pattern = f"train-{{000000..{len(paths) - 1:06d}}}.tar"
            if name == "1x":
                results["folder"] = run_measurement(args, "folder", data, pattern)
            results[f"shards_{name}"] = run_measurement(args, "shards", data, pattern)
        for what, r in results.items():
            count = f"images={r['samples']}" if what == "folder" else f"shards={shards[what.split('_')[1]]}"
            print(f"webdataset_scale {what} {count} samples={r['samples']} samples_per_s={r['timed'] / r['seconds']:.0f} "
                  f"main_peak_mb={r['main_peak_mb']:.0f} (+{r['main_peak_mb'] - r['before_mb']:.0f} in the epoch) "
                  f"worker_peak_mb={r['worker_peak_mb']:.0f} worker_private_peak_mb={r['worker_private_peak_mb']:.0f}")
        one, ten, folder = results["shards_1x"], results[f"shards_{args.scale}x"], results["folder"]
        speed = (one["timed"] / one["seconds"]) / (folder["timed"] / folder["seconds"])
        print(f"webdataset_scale ratios shards_vs_folder_samples_per_s={speed:.2f} "
              + " ".join(f"{k.removesuffix('_mb')}_{args.scale}x_vs_1x={ten[k] / one[k]:.2f}"
                         for k in ("main_peak_mb", "worker_peak_mb", "worker_private_peak_mb")))

if __name__ == "__main__":
    main()
