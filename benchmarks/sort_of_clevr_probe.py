#!/usr/bin/env python
"""Linear probe of a trained Sort-of-CLEVR run: can each object's position and shape be read
linearly from the model's visual tokens? (See mmvl/models/probe.py for why.)

    python benchmarks/sort_of_clevr_probe.py SAVE_DIR [--checkpoint best|last|none]
        [--module NAME[:LAST_TOKENS] ...] [--fit 4000] [--test 2000] [key=value ...]

SAVE_DIR is a run's env.save_dir (its config.yaml and checkpoints/ are read). The read-out is
fitted on --fit training questions and scored on --test validation questions; one row per
probed module. ``--checkpoint none`` probes the untrained model (the same config, seed and
init), the baseline a trained model's figures should beat.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Subset

#: modules probed by default: the visual tokens entering the fusion, and after it
DEFAULT_MODULES = {"visual_bert": ["visual_embeddings", "bert.encoder:25"],
                   "relation_network": ["image_encoder"],
                   "mmbt": ["visual.image_encoder"], "concat_bert": ["visual.image_encoder"]}


def samples(builder, split: str, count: int, seed: int, batch_size: int):
    """(batches, scene dict of tensors) for ``count`` random questions of ``split``."""
    dataset = builder.build(split)
    rng = np.random.default_rng(seed)
    index = np.sort(rng.choice(len(dataset), size=min(count, len(dataset)), replace=False))
    questions = builder.questions(split)
    scenes = builder.scenes(split)
    images = np.array([questions[i]["image"] for i in index])
    scene = {"centers": torch.from_numpy(scenes["centers"][images]), "shapes": torch.from_numpy(scenes["shapes"][images]),
             "queried": torch.tensor([questions[i]["color"] for i in index])}
    loader = DataLoader(Subset(dataset, index.tolist()), batch_size=batch_size, collate_fn=builder.collate)
    return loader, scene


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("save_dir")
    parser.add_argument("--checkpoint", default="best", help="best | last | none | a path")
    parser.add_argument("--module", action="append", help="sub-module[:last N tokens]; default by model")
    parser.add_argument("--fit", type=int, default=4000)
    parser.add_argument("--test", type=int, default=2000)
    parser.add_argument("--l2", type=float, nargs="+", default=[1e-4, 1e-3, 1e-2, 1e-1, 1.0],
                        help="ridge penalty; several: chosen on a fifth of the fit samples")
    args, overrides = parser.parse_known_args(argv)

    import mmvl  # noqa: F401  (registers everything)
    from mmvl.build import build_datasets, build_model
    from mmvl.checkpoint import load_model_state
    from mmvl.io import safe_load
    from mmvl.config import load_config
    from mmvl.models.probe import collect_outputs, probe_objects
    from mmvl.utils.rng import seed_everything

    save = Path(args.save_dir)
    config = load_config([f"config={save / 'config.yaml'}", *overrides])
    seed_everything(int(config.training.seed))  # as the Trainer does: --checkpoint none is the run's init
    builders = build_datasets(config)
    builder = builders["sort_of_clevr"]
    builder.prepare()
    model = build_model(config, builders)
    if args.checkpoint != "none":
        path = Path(args.checkpoint) if args.checkpoint not in ("best", "last") else \
            save / "checkpoints" / f"{args.checkpoint}.ckpt"
        load_model_state(model, safe_load(path))
    size = float(builder.params["image_size"])
    fit_loader, fit_scene = samples(builder, "train", args.fit, 0, 100)
    test_loader, test_scene = samples(builder, "val", args.test, 1, 100)
    for spec in args.module or DEFAULT_MODULES.get(str(config.model), ["image_encoder"]):
        name, _, last = spec.partition(":")
        x_fit = collect_outputs(model, fit_loader, name, int(last) if last else None)
        x_test = collect_outputs(model, test_loader, name, int(last) if last else None)
        result = probe_objects(x_fit, fit_scene, x_test, test_scene, size, args.l2 if len(args.l2) > 1 else args.l2[0])
        print(json.dumps({"run": str(save), "checkpoint": args.checkpoint, "module": spec,
                          "features": x_fit.shape[1], **{k: round(v, 4) for k, v in result.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
