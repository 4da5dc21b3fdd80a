"""Does mmvl's Trainer train a model exactly as a plain PyTorch loop does? Same config, both ways, compare weights.

    python benchmarks/parity.py                                   # relation_network and visual_bert, 200 updates
    python benchmarks/parity.py --models relation_network --updates 50 --max-samples 2000
    python benchmarks/parity.py --evaluate-every 50               # the Trainer also evaluates on val meanwhile

Each model trains on easy-VQA (``pip install mmvl[easy_vqa]``) from its project config
(``projects/<model>/configs/easy_vqa/defaults.yaml``, ``visual_bert`` shrunk to a tiny size) twice, in this
process, on the CPU, fp32:

- **mmvl**: :class:`mmvl.trainers.Trainer` built from the config, ``fit()`` for ``--updates`` updates (run_type
  train, every built-in callback on; ``--evaluate-every`` adds val evaluations);
- **plain**: a loop written out by hand below (:func:`plain_loop`): seed, build the registered model from the
  same model config, AdamW over hand-made parameter groups, the warm-up/linear-decay lambda written out,
  batches in the order of ``torch.randperm`` seeded with ``seed + epoch`` (the last partial batch
  dropped), forward, cross entropy, backward, gradient clipping, step, zero_grad, schedule.

Then it prints, per model, the largest absolute difference between the two runs' weights and whether every
weight agrees within ``--atol``/``--rtol``; the exit status is 1 when a model does not.

What the plain loop does because mmvl does it by default, deliberately (both sides then do the same;
docs/easy_vqa.md lists these):

- weight decay only on weight matrices and embeddings: biases and normalisation layers' parameters in a
  group with ``weight_decay=0`` (:func:`mmvl.optim.param_groups`);
- AdamW's fused implementation on the CPU where torch has it (``fused=True``);
- the random number generators seeded with ``training.seed`` before the model is built and again after
  (dropout draws start from the seed, whatever building consumed);
- the data order: a permutation per epoch from a generator seeded with ``seed + epoch``, not the global RNG.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("relation_network", "visual_bert")
#: overrides that make each model small enough for a quick CPU comparison (visual_bert "tiny")
SIZES = {
    "relation_network": [],
    "visual_bert": [f"model_config.visual_bert.{k}" for k in (
        "hidden_size=32", "num_hidden_layers=1", "num_attention_heads=2", "intermediate_size=64",
        "image_encoder.params.channels=[8,16,16,16]")],
}
NORMS = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.modules.batchnorm._NormBase)


def load(model: str, updates: int, save_dir: str, data_dir: str, max_samples: int | None,
         extra: list[str]) -> Any:
    from mmvl.config import load_config

    overrides = [f"config={ROOT / 'projects' / model / 'configs' / 'easy_vqa' / 'defaults.yaml'}",
                 f"env.save_dir={save_dir}", f"env.data_dir={data_dir}", "run_type=train",
                 f"training.max_updates={updates}", "training.progress_bar=false", "training.num_workers=0",
                 f"training.checkpoint_interval={updates}", "training.trackers=[]", "training.curves=false",
                 f"dataset_config.easy_vqa.max_samples={max_samples or 'null'}", *SIZES[model], *extra]
    return load_config(overrides)


def mmvl_weights(config: Any, evaluate_every: int | None) -> dict[str, torch.Tensor]:
    from omegaconf import OmegaConf

    from mmvl.trainers import Trainer

    if evaluate_every:
        config = OmegaConf.merge(config, {"run_type": "train_val",
                                          "training": {"evaluation_interval": evaluate_every}})
    trainer = Trainer(config)
    trainer.fit()
    model = trainer.engine.unwrap_model(trainer.model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def plain_loop(config: Any) -> tuple[dict[str, torch.Tensor], float]:
    """The same training as the Trainer's, written the way a PyTorch user writes it: the final weights and
    how far the farthest weight moved from its initial value (a comparison of untrained models proves nothing)."""
    from mmvl.build import build_datasets, model_config
    from mmvl.registry import MODELS as REGISTERED

    t, opt, sched = config.training, config.optimizer.params, config.scheduler.params
    seed, batch_size, updates = int(t.seed), int(t.batch_size), int(t.max_updates)
    builders = build_datasets(config)  # the data (not what is compared): the same dataset objects' items
    (builder,) = builders.values()
    for b in builders.values():
        b.prepare()
        b.prepare_split("train")
    dataset = builder.build("train")

    seed_all(seed)
    model = REGISTERED.get(str(config.model))(model_config(config, builders))
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    decay, no_decay = [], []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad:
                (no_decay if isinstance(module, NORMS) or name.endswith("bias") else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": float(opt.weight_decay)},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=float(opt.lr), eps=float(opt.eps), fused=True)
    total = updates
    warmup = min(int(sched.num_warmup_steps), total)  # mmvl clamps a warm-up longer than the run (and warns)

    def factor(step: int) -> float:  # linear warm-up to the lr, then linear decay to 0 at the last update
        if step < warmup:
            return step / max(1, warmup)
        return 1.0 - min(1.0, (step - warmup) / max(1, total - warmup))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    clip = t.get("clip_grad_norm")
    seed_all(seed)  # dropout draws from the seed on
    model.train()
    per_epoch, step, epoch = len(dataset) // batch_size, 0, 0
    while step < updates:
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        for b in range(per_epoch):
            if step == updates:
                break
            batch = builder.collate([dataset[i] for i in order[b * batch_size:(b + 1) * batch_size]])
            loss = F.cross_entropy(model(batch)["scores"], batch["targets"])
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), float(clip))
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            step += 1
        epoch += 1
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return final, max(((final[k] - v).abs().max().item() for k, v in initial.items() if v.numel()), default=0.0)


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float,
            rtol: float) -> tuple[bool, float, str]:
    """(every tensor close, the largest absolute difference, the tensor it is in)."""
    if a.keys() != b.keys():
        return False, math.inf, f"different keys: {sorted(a.keys() ^ b.keys())[:3]}"
    worst, where, ok = 0.0, "", True
    for name in a:
        x, y = a[name].double(), b[name].double()
        diff = (x - y).abs().max().item() if x.numel() else 0.0
        ok = ok and torch.allclose(x, y, atol=atol, rtol=rtol)
        if diff > worst:
            worst, where = diff, name
    return ok, worst, where


def run(model: str, updates: int, max_samples: int | None, atol: float, rtol: float,
        evaluate_every: int | None = None, extra: list[str] | None = None) -> dict[str, Any]:
    """Train ``model`` both ways; the comparison as a dict (also what the test reads)."""
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = os.path.join(tmp, "data")
        config = load(model, updates, os.path.join(tmp, "plain"), data_dir, max_samples, list(extra or []))
        plain, moved = plain_loop(config)
        config = load(model, updates, os.path.join(tmp, "mmvl"), data_dir, max_samples, list(extra or []))
        trained = mmvl_weights(config, evaluate_every)
    ok, worst, where = compare(trained, plain, atol, rtol)
    return {"model": model, "updates": updates, "equal": ok, "max_abs_diff": worst, "where": where,
            "moved": moved}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--updates", type=int, default=200)
    parser.add_argument("--max-samples", type=int, default=None, help="cap easy-VQA's splits (faster loading)")
    parser.add_argument("--atol", type=float, default=1e-5)
    parser.add_argument("--rtol", type=float, default=1e-4)
    parser.add_argument("--evaluate-every", type=int, default=None, help="the Trainer evaluates on val this often")
    parser.add_argument("overrides", nargs="*", help="config overrides for both sides, e.g. training.seed=2")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    failed = 0
    for model in args.models:
        r = run(model, args.updates, args.max_samples, args.atol, args.rtol, args.evaluate_every, args.overrides)
        verdict = "equal" if r["equal"] else "DIFFERENT"
        print(f"{model}: {verdict} after {r['updates']} updates; largest |mmvl - plain| = {r['max_abs_diff']:.3g}"
              f" (in {r['where'] or '-'}; the weights moved up to {r['moved']:.3g} from their initial values); "
              f"atol {args.atol}, rtol {args.rtol}", flush=True)
        failed += not r["equal"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
