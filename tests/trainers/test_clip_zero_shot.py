"""The tiny CLIP recipe learns: zero-shot accuracy over the colours its captions name rises well above chance
(what docs/contrastive.md shows), measured before and after training in the same test."""
from __future__ import annotations

import json

import numpy as np
import pytest

from mmvl.config import load_config
from mmvl.data.shard_writer import write_shards
from mmvl.trainers import Trainer

TINY = "projects/clip/configs/image_text_shards/tiny.yaml"
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220), "yellow": (230, 220, 30),
           "purple": (150, 40, 200), "orange": (250, 140, 20), "white": (245, 245, 245), "black": (10, 10, 10)}
CORNERS = {"top left": (0, 0), "top right": (0, 20), "bottom left": (20, 0), "bottom right": (20, 20)}


def write_colour_shards(root, seed: int = 1) -> None:
    """docs/contrastive.md's pairs: a colour in a corner of a noisy 32 px image, a caption naming both."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    (root / "images").mkdir()
    for split, n in (("train", 512), ("val", 64)):
        lines = []
        for k in range(n):
            colour, corner = rng.choice(list(COLOURS)), list(CORNERS)[rng.integers(4)]
            pixels = rng.integers(90, 160, (32, 32, 3)).astype(np.uint8)
            y, x = CORNERS[corner]
            pixels[y:y + 12, x:x + 12] = COLOURS[colour]
            Image.fromarray(pixels).save(root / "images" / f"{split}{k:04d}.png")
            lines.append(json.dumps({"image": f"{split}{k:04d}.png", "caption": f"a {colour} square at the {corner}"}))
        (root / f"{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
        write_shards(root / "images", root / f"{split}.jsonl", root / "shards", prefix=split, samples_per_shard=64)


@pytest.mark.slow  # ~10-25 s: 150 updates of the tiny recipe, two evaluations
def test_tiny_recipe_zero_shot_accuracy_rises_above_chance(tmp_path):
    write_colour_shards(tmp_path)
    trainer = Trainer(load_config([f"config={TINY}", f"env.data_dir={tmp_path}", f"env.save_dir={tmp_path}/save"]))
    metric = trainer.config.dataset_config.image_text_shards.metrics[-1]
    chance = 1 / len(metric.params.classnames)
    before = trainer.evaluate("val")["image_text_shards"]
    trainer.fit()
    after = trainer.evaluate("val")["image_text_shards"]
    assert after["zero_shot_top1"] > chance + 0.3, (before, after)
    assert after["zero_shot_top1"] > before["zero_shot_top1"] + 0.3, (before, after)
    # retrieval over the whole val split, beside the in-batch recall@k, also learns
    assert after["t2i_recall@5"] > before["t2i_recall@5"] and after["mean_recall"] > before["mean_recall"]
