"""``training.packing`` against padded batches, shuffled and grouped by length: real (non-pad) tokens
per second of training updates, the same VLM and the same samples, interleaved in one process.

    python benchmarks/packing.py                                   # both sets
    python benchmarks/packing.py --set llava --packing-length 1024  # one set, another row length
    python benchmarks/packing.py --updates 2 --rounds 1 --smoke      # a smoke run (tiny model)
    python benchmarks/packing.py training.batch_size=16              # key=value pairs: as mmvl_run's

Sets: ``easy_vqa`` is ``projects/vlm/configs/easy_vqa_conversations/defaults.yaml`` (pip install
mmvl[easy_vqa]); ``llava`` is a LLaVA-JSON set written here (one image or none, 1 to 8 turns: from
tens to hundreds of tokens a conversation) on the same model. For each set three Trainers are built
with the same seed (the same initial weights): shuffled and padded (``group_by_length=false``),
grouped (``group_by_length=true``), packed (``packing=true``, rows of ``--packing-length`` tokens).

Each side trains whole epochs, so the three train on the same samples, grouping only reordering
them: the rates compare the same work (over a few batches, grouped batches of long or of short
samples would tilt them, as an image costs the same whatever its text). After one untimed update
each (first-call work), every side's data goes back to the epoch's start; then ``--rounds`` epochs
are timed, the three in turns of ``--updates`` updates (the order rotating), so the machine's drift
falls on all three alike. Printed per set: each side's time, positions and real tokens a sample, and
the lines ``packed/grouped R`` and ``packed/shuffled R`` (ratios of real tokens per second over the
timed epochs) and ``real positions packed F`` (the share of the packed rows' positions that are real
tokens).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.group_by_length import SMOKE, parsed, trainer_arguments  # noqa: E402  (the tree first on sys.path)
from benchmarks.timing import timed  # noqa: E402

CONFIG = os.path.join(ROOT, "projects", "vlm", "configs", "easy_vqa_conversations", "defaults.yaml")
WORDS = ("what which where is are the a an of in on left right above below color shape size red green blue "
         "yellow black white big small circle square triangle there one two three more fewer than and or not").split()
SIDES = {"shuffled": ["training.group_by_length=false"], "grouped": ["training.group_by_length=true"],
         "packed": ["training.group_by_length=false", "training.packing=true"]}


def write_llava(folder: str, n: int = 1200, seed: int = 0) -> list[str]:
    """A LLaVA JSON set of ``n`` conversations about one-colour images (every fifth text-only), 1 to 8
    turns of 2 to 40 words; the keys that run the shipped model on it."""
    from PIL import Image

    rng = random.Random(seed)
    os.makedirs(os.path.join(folder, "images"), exist_ok=True)
    colours = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220), "yellow": (220, 220, 30)}
    for name, rgb in colours.items():
        Image.new("RGB", (64, 64), rgb).save(os.path.join(folder, "images", f"{name}.png"))

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    rows = []
    for i in range(n):
        turns = []
        for t in range(rng.choice([1, 1, 2, 3, 4, 6, 8])):
            turns += [{"from": "human", "value": text(2, 20)}, {"from": "gpt", "value": text(1, 30)}]
        row: dict[str, Any] = {"id": f"s{i}", "conversations": turns}
        if i % 5:
            row["image"] = f"{rng.choice(list(colours))}.png"
            turns[0]["value"] = "<image>\n" + turns[0]["value"]
        rows.append(row)
    with open(os.path.join(folder, "train.json"), "w") as f:
        json.dump(rows, f)
    d = "dataset_config.llava"
    return ["datasets=llava", f"{d}.annotations.train={folder}/train.json", f"{d}.image_folder={folder}/images",
            f"{d}.processors.text_processor.params.max_length=512",
            "model_config.vlm.language_model.random.max_position_embeddings=1024",
            "training.early_stop.criteria=llava/answer_tokens", "evaluation.metrics=[]"]


class Steps:
    """``run(n)``: ``n`` updates of one Trainer, counting the positions and real tokens it drew."""

    def __init__(self, trainer: Any, pad_id: int):
        self.trainer, self.pad_id = trainer, pad_id
        self.positions = self.real = self.samples = 0
        self.stream = stream = trainer.train_data

        def counted() -> Any:
            while True:
                batch = next(stream)
                ids = batch["input_ids"]
                self.positions += ids.numel()
                mask = batch.get("attention_mask")
                self.real += int(mask.sum()) if "position_ids" not in batch and mask is not None \
                    else int(ids.ne(self.pad_id).sum())
                yield batch

        trainer.train_data = counted()

    def run(self, n: int) -> None:
        for _ in range(n):
            self.samples += int(self.trainer.train_step()["samples"])


def build(side: str, args: argparse.Namespace, data: list[str], save_dir: str) -> Steps:
    from mmvl.config import load_config
    from mmvl.trainers import Trainer

    opts = [f"config={CONFIG}", "run_type=train", f"training.batch_size={args.batch}", f"env.save_dir={save_dir}",
            "training.progress_bar=false", "training.tensorboard=false", "training.curves=false", "training.num_workers=0",
            f"training.packing_length={args.packing_length or 'null'}", *SIDES[side], *data,
            *(SMOKE if args.smoke else []), *args.opts]
    trainer = Trainer(load_config(opts))
    builder = next(iter(trainer.builders.values()))
    return Steps(trainer, int(builder.model_info()["pad_token_id"]))


def epoch(sides: dict[str, Steps], turn: int) -> dict[str, float]:
    """One epoch of each side from its start, in turns of ``turn`` updates (the order rotating): the
    seconds each took."""
    seconds = dict.fromkeys(sides, 0.0)
    left, r = next(iter(sides.values())).stream.batches_per_epoch, 0
    while left:
        n = min(turn, left)
        for side in list(sides)[r % len(sides):] + list(sides)[: r % len(sides)]:
            seconds[side] += timed(sides[side], n) * n
        left, r = left - n, r + 1
    return seconds


def measure(name: str, data: list[str], args: argparse.Namespace, tmp: str) -> None:
    sides = {side: build(side, args, data, os.path.join(tmp, f"{name}_{side}")) for side in SIDES}
    if len({steps.stream.batches_per_epoch for steps in sides.values()}) != 1:
        raise SystemExit(f"set {name}: the sides' epochs differ in length; the comparison needs the same samples")
    for steps in sides.values():
        steps.run(1)  # untimed: first-call work
        steps.stream.load_state_dict({"epoch": 0, "batch": 0})  # back to the epoch's start
        steps.positions = steps.real = steps.samples = 0
    seconds = dict.fromkeys(sides, 0.0)
    for _ in range(args.rounds):
        for side, took in epoch(sides, args.updates).items():
            seconds[side] += took
    updates = args.rounds * next(iter(sides.values())).stream.batches_per_epoch
    rate = {side: steps.real / seconds[side] for side, steps in sides.items()}
    same = len({(steps.samples, steps.real) for steps in sides.values()}) == 1
    print(f"set {name}: {updates} timed updates a side, {sides['packed'].samples} samples, the same for each: {same}")
    for side, steps in sides.items():
        print(f"  {side}: {1e3 * seconds[side] / updates:.1f} ms/update, "
              f"{steps.positions / max(1, steps.samples):.1f} positions/sample, "
              f"{steps.real / max(1, steps.samples):.1f} real tokens/sample, {rate[side]:.0f} real tokens/s")
    for other in ("grouped", "shuffled"):
        print(f"packed/{other} {rate['packed'] / rate[other]:.3f}")
    packed = sides["packed"]
    print(f"real positions packed {packed.real / max(1, packed.positions):.3f}")


def main() -> int:
    parser = trainer_arguments(__doc__, updates=5)
    parser.set_defaults(rounds=1)
    parser.add_argument("--set", choices=["easy_vqa", "llava", "both"], default="both")
    parser.add_argument("--packing-length", type=int, default=0, help="rows' tokens (0: one row a micro-batch)")
    args = parsed(parser)
    with tempfile.TemporaryDirectory() as tmp:
        if args.set in ("easy_vqa", "both"):
            measure("easy_vqa_conversations", [], args, tmp)
        if args.set in ("llava", "both"):
            measure("llava", write_llava(os.path.join(tmp, "llava_data"), n=400 if args.smoke else 1200), args, tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
