"""A tiny demo run leaves TensorBoard events and curves.png in its save dir; both read back."""
from __future__ import annotations

import json

import pytest
from PIL import Image

from mmvl_cli.run import main
from tests.e2e.test_sort_of_clevr_run import tiny_opts

pytest.importorskip("tensorboard")


def test_demo_run_leaves_events_and_curves(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert main(tiny_opts(tmp_path) + ["training.evaluation_interval=2", "training.clip_grad_norm=1.0"]) == 0
    save = tmp_path / "save"
    events = [json.loads(line) for line in open(save / "metrics.jsonl")]
    acc = EventAccumulator(str(save / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for event in events:
        prefix = "train" if event["split"] == "train" else f"val/{event['dataset']}"
        for key in ("total_loss", "lr", "grad_norm", "samples_per_s", "accuracy", "accuracy/relational"):
            if key in event:
                got = {s.step: s.value for s in acc.Scalars(f"{prefix}/{key}")}
                assert got[event["update"]] == pytest.approx(event[key], rel=1e-6), (prefix, key)
    assert {"train/total_loss", "train/cross_entropy", "train/lr", "train/grad_norm",
            "val/sort_of_clevr/accuracy", "val/sort_of_clevr/accuracy/prior"} <= tags

    png = save / "curves.png"
    assert 10_000 < png.stat().st_size < 400_000
    with Image.open(png) as image:
        assert image.format == "PNG"
        width, height = image.size
        assert 500 <= width <= 1400 and 350 <= height <= 1200  # 2x2 panels at 80 dpi
        colours = image.convert("RGB").getcolors(maxcolors=1 << 16)
        assert colours is None or len(colours) > 50  # drawn lines and text, not a blank canvas
    assert not list(save.glob(".curves.png.*"))  # the atomic writer left no temp file
