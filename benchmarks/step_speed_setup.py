"""The parts of ``step_speed.py`` every variant shares: presets, synthetic data, model, optimizer,
config, the clock (which also counts torch.compile recompiles while timing) and the FLOP count.

Kept apart from the variants and the report so each file stays small; ``step_speed.py``
re-exports ``PRESETS`` and ``model_options`` (``scaling_model.py`` reads them).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # mmvl from this source tree (PYTHONPATH alone, no install)

PRESETS: dict[str, dict[str, Any]] = {
    # text: tokens per question, the same for every sample: no padding, so every batch has the same
    # shapes and a compiled model never recompiles for a new length while it is timed
    # CPU, seconds: what CI runs
    "tiny": dict(hidden=32, layers=1, heads=2, intermediate=64, batch=8, text=8, regions=4, answers=16,
                 vocab=100, samples=64, warmup=2, updates=3, repeats=1, device="cpu", precision="fp32",
                 workers=0),
    # CPU, a 2-layer h256 model: the Trainer's per-update overhead against the plain loop
    "small": dict(hidden=256, layers=2, heads=4, intermediate=1024, batch=32, text=16, regions=36,
                  answers=3129, vocab=30522, samples=512, warmup=5, updates=20, repeats=3, device="cpu",
                  precision="fp32", workers=0),
    # one GPU, BERT-base on VQA-sized inputs (32 text tokens, 100 regions)
    "base": dict(hidden=768, layers=12, heads=12, intermediate=3072, batch=128, text=32, regions=100,
                 answers=3129, vocab=30522, samples=4096, warmup=10, updates=40, repeats=3, device="cuda",
                 precision="bf16", workers=4),
}
DATASET = "step_speed_synthetic"
LR, WARMUP_STEPS, TRAINING_STEPS = 5e-5, 1000, 100_000  # the schedule of a long run (still warming up here)


# -- data ----------------------------------------------------------------------------------------
class SyntheticRegions(torch.utils.data.Dataset):
    """Region features (fp16), boxes, ``text`` token ids and one answer per sample.

    Made once per preset (``synthetic``) and shared by every variant: the base preset holds
    1.6 GB of features.
    """

    def __init__(self, p: dict[str, Any], seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        n, m, length = p["samples"], p["regions"], p["text"]
        self.features = torch.randn(n, m, 2048, generator=g).to(torch.float16)
        xy = torch.rand(n, m, 2, generator=g) * 0.5
        self.boxes = torch.cat([xy, xy + 0.1 + torch.rand(n, m, 2, generator=g) * 0.4], dim=-1)
        self.ids = torch.randint(5, p["vocab"], (n, length), generator=g)
        self.answers = torch.randint(0, p["answers"], (n,), generator=g).tolist()
        self.num_answers = p["answers"]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids = self.ids[i]
        targets = torch.zeros(self.num_answers)
        targets[self.answers[i]] = 1.0
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids),
                "features": self.features[i], "boxes": self.boxes[i],
                "feature_mask": torch.ones(self.features.shape[1], dtype=torch.long), "targets": targets, "id": i}


_DATA: dict[str, SyntheticRegions] = {}


def synthetic(p: dict[str, Any]) -> SyntheticRegions:
    key = repr(sorted(p.items()))
    if key not in _DATA:
        _DATA.clear()
        _DATA[key] = SyntheticRegions(p)
    return _DATA[key]


def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    from mmvl.data.sample import collate as mmvl_collate

    return mmvl_collate(items)


def register_dataset(p: dict[str, Any]) -> None:
    """The synthetic data as a registered dataset, so the Trainer builds it like any other."""
    from mmvl import registry
    from mmvl.data.base import DatasetBuilder

    class SyntheticBuilder(DatasetBuilder):
        def build(self, split: str) -> SyntheticRegions:
            return synthetic(p)

        def model_info(self) -> dict[str, int]:
            return {"num_labels": p["answers"], "vocab_size": p["vocab"]}

    if DATASET in registry.DATASETS:
        registry.DATASETS.unregister(DATASET)  # re-registered per preset
    registry.DATASETS.register(DATASET, SyntheticBuilder)


def loader(p: dict[str, Any], device: torch.device) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(
        synthetic(p), batch_size=p["batch"], shuffle=True, drop_last=True, collate_fn=collate,
        num_workers=p["workers"], pin_memory=device.type == "cuda", persistent_workers=p["workers"] > 0,
        generator=torch.Generator().manual_seed(0))


def forever(data: Any):
    while True:
        yield from data


# -- model, optimizer, config ------------------------------------------------------------------------
def model_options(p: dict[str, Any]) -> dict[str, Any]:
    return {"feature_dim": 2048, "hidden_size": p["hidden"], "num_hidden_layers": p["layers"],
            "num_attention_heads": p["heads"], "intermediate_size": p["intermediate"],
            "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1, "vocab_size": p["vocab"],
            "num_labels": p["answers"], "max_position_embeddings": 512}


def config(p: dict[str, Any], args: argparse.Namespace, save_dir: str, updates: int):
    from mmvl.config import load_config

    opts = ["model=visual_bert", f"datasets={DATASET}", f"env.save_dir={save_dir}",
            f"env.data_dir={save_dir}", "run_type=train", f"training.max_updates={updates}",
            f"training.batch_size={p['batch']}", f"training.num_workers={p['workers']}",
            f"training.precision={args.precision}", f"training.device={args.device}",
            f"training.compile={str(args.compile).lower()}", "training.checkpoint_interval=0",
            "training.pin_memory=auto",
            f"optimizer.params.lr={LR}", f"scheduler.params.num_warmup_steps={WARMUP_STEPS}",
            f"scheduler.params.num_training_steps={TRAINING_STEPS}",
            "model_config.visual_bert.losses=[{type: logit_bce}]"]
    opts += [f"model_config.visual_bert.{k}={v}" for k, v in model_options(p).items()]
    return load_config(opts + [f"training.prefetch={str(not args.no_prefetch).lower()}"])


def new_model(p: dict[str, Any]) -> torch.nn.Module:
    from omegaconf import OmegaConf

    from mmvl.models import VisualBert

    torch.manual_seed(0)
    return VisualBert(OmegaConf.create({**model_options(p), "losses": [{"type": "logit_bce"}]}))


def new_optimizer(model: torch.nn.Module, device: torch.device):
    from mmvl.optim import fused_supported

    # fused where mmvl's build_optimizer makes it fused (the Trainer and Engine variants), so all compare alike
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, fused=fused_supported(device))
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, step / WARMUP_STEPS))
    return optimizer, warmup


def loss_of(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """VQA's logit_bce (mmvl's registered loss): BCE summed over answers, averaged over the batch."""
    return torch.nn.functional.binary_cross_entropy_with_logits(scores, targets.to(scores.dtype)) * targets.size(1)


def autocast(device: torch.device, precision: str):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()


def compile_events() -> int:
    """Frames torch.compile (Dynamo) has translated so far in this process, first compiles and recompiles.

    ``torch._dynamo.utils.counters["frames"]["total"]`` (torch 2.0 and later, 2.4-2.14 checked
    here): Dynamo adds one each time it translates a frame, so a new shape, a failed guard
    or a graph break seen for the first time all count. Global to the process, which is why
    the clock reads it only while its own variant runs.
    """
    from torch._dynamo.utils import counters

    return int(counters["frames"]["total"])


class Clock:
    """Times a variant's updates after the first ``warmup``; runners call ``tick(update)`` after each.

    Alone (``baton=None``, the GPU default): the seconds from the end of update ``warmup`` to
    the end of the last one, after waiting for the device. Interleaved (the CPU default): the
    variants run in threads that take turns one update at a time (``Baton``), so a busy
    machine slows them all alike, and each update is timed on its own. ``process`` measures
    CPU seconds of this process instead of wall seconds (one thread: leaves out the time
    spent waiting for a core). ``recompiles``: Dynamo translations (``compile_events``) inside
    the timed updates; with fixed shapes 0, and anything else means a compile was timed.
    """

    def __init__(self, device: torch.device, warmup: int, updates: int, kind: str = "wall",
                 baton: "Baton | None" = None, name: str = ""):
        self.device, self.warmup, self.last = device, warmup, warmup + updates
        self.now = time.process_time if kind == "process" else time.perf_counter
        self.baton, self.name = baton, name
        self.times: list[float] = []  # seconds per update
        self.recompiles = 0
        self.start, self.events = 0.0, 0

    def begin(self) -> None:
        self.start, self.events = self.now(), compile_events()

    def tick(self, update: int) -> None:
        if self.baton is None:
            if update in (self.warmup, self.last):
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                if update == self.warmup:
                    self.start, self.events = self.now(), compile_events()
                else:
                    self.times.append((self.now() - self.start) / (self.last - self.warmup))
                    self.recompiles += compile_events() - self.events
            return
        if update > self.warmup:  # only this thread ran since start: the events are its own
            self.times.append(self.now() - self.start)
            self.recompiles += compile_events() - self.events
        if update < self.last:
            self.baton.pass_on(self.name)
            self.begin()


class Baton:
    """Round-robin turns between variant threads: one update each, in a fixed order."""

    def __init__(self, names: list[str]):
        self.order, self.active, self.turn = list(names), set(names), 0
        self.cond = threading.Condition()

    def wait(self, name: str) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.order[self.turn] == name)

    def _advance(self) -> None:
        for _ in range(len(self.order)):
            self.turn = (self.turn + 1) % len(self.order)
            if self.order[self.turn] in self.active:
                break
        self.cond.notify_all()

    def pass_on(self, name: str) -> None:
        with self.cond:
            self._advance()
        self.wait(name)

    def finish(self, name: str) -> None:
        with self.cond:
            self.active.discard(name)
            if self.active:
                self._advance()


def one_batch(p: dict[str, Any], device: torch.device) -> dict[str, Any]:
    data = synthetic(p)
    batch = collate([data[i] for i in range(p["batch"])])
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def model_graph_breaks(p: dict[str, Any], args: argparse.Namespace, device: torch.device) -> list[str]:
    """Dynamo's graph breaks of the model's forward and loss in training mode, on one batch."""
    from mmvl.utils.compile import graph_breaks

    model, batch = new_model(p).to(device).train(), one_batch(p, device)

    def step(batch: dict[str, Any]) -> torch.Tensor:
        with autocast(device, args.precision):
            return loss_of(model(batch)["scores"], batch["targets"])

    return graph_breaks(step, batch)


def flops_per_sample(p: dict[str, Any], args: argparse.Namespace, device: torch.device) -> float:
    """Forward + backward FLOPs of one sample, counted once on one batch of the model (eager)."""
    from mmvl.utils.flops import count_flops

    model = new_model(p).to(device).train()
    batch = one_batch(p, device)

    def update() -> None:
        with autocast(device, args.precision):
            loss = loss_of(model(batch)["scores"], batch["targets"])
        loss.backward()

    total = count_flops(update)
    del model
    return total / p["batch"]


