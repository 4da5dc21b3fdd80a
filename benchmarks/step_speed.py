"""Time per update of one model under a plain PyTorch loop, mmvl's Engine, mmvl's Trainer,
Accelerate and Lightning: same model, data, optimizer and precision, one process.

    python benchmarks/step_speed.py --preset small            # CPU, 2-layer h256
    python benchmarks/step_speed.py --preset base --compile   # GPU, BERT-base, batch 128, bf16
    python benchmarks/step_speed.py --preset small --threads 1 --clock process   # a busy CPU

The model is the registered ``visual_bert`` on region features (``feature_dim: 2048``,
boxes, a 3,129-answer VQA head with ``logit_bce``); the data are synthetic region
features (fp16) and token ids held in host memory and served through a DataLoader, the
way real batches arrive. Every variant trains with AdamW (fused on CUDA) and a linear
warm-up schedule; the variants run alternately (``--repeats`` rounds), each for
``--warmup`` untimed updates and then ``--updates`` timed ones, and the median per
variant is reported: ms/update, samples/s, MFU (FLOPs of one update counted once with
``torch.utils.flop_counter``; peak FLOP/s from mmvl's table of GPUs or ``--peak-tflops``)
and the ratio to the plain loop. The mmvl Trainer runs with its default callbacks
(logging every ``training.log_interval``, checkpoint and preemption checks); Accelerate and
Lightning come from the optional ``bench`` extra (``pip install -e ".[bench]"``) and are
skipped with a note when missing. Lightning runs without logger, checkpointing, progress
bar and model summary (none of them is part of an update).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
VARIANTS = ("plain", "engine", "trainer", "accelerate", "lightning")
PRESETS: dict[str, dict[str, Any]] = {
    # CPU, seconds: what CI runs
    "tiny": dict(hidden=32, layers=1, heads=2, intermediate=64, batch=8, text=(6, 10), regions=4, answers=16,
                 vocab=100, samples=64, warmup=2, updates=3, repeats=1, device="cpu", precision="fp32",
                 workers=0),
    # CPU, a 2-layer h256 model: the Trainer's per-update overhead against the plain loop
    "small": dict(hidden=256, layers=2, heads=4, intermediate=1024, batch=32, text=(14, 20), regions=36,
                  answers=3129, vocab=30522, samples=512, warmup=5, updates=20, repeats=3, device="cpu",
                  precision="fp32", workers=0),
    # one GPU, BERT-base on VQA-sized inputs (20-48 text tokens, 100 regions)
    "base": dict(hidden=768, layers=12, heads=12, intermediate=3072, batch=128, text=(20, 48), regions=100,
                 answers=3129, vocab=30522, samples=4096, warmup=10, updates=40, repeats=3, device="cuda",
                 precision="bf16", workers=4),
}
DATASET = "step_speed_synthetic"
LR, WARMUP_STEPS, TRAINING_STEPS = 5e-5, 1000, 100_000  # the schedule of a long run (still warming up here)


# -- data ----------------------------------------------------------------------------------------
class SyntheticRegions(torch.utils.data.Dataset):
    """Region features (fp16), boxes, token ids of varying length and one answer per sample.

    Made once per preset (``synthetic``) and shared by every variant: the base preset holds
    1.6 GB of features.
    """

    def __init__(self, p: dict[str, Any], seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        n, m, (short, long) = p["samples"], p["regions"], p["text"]
        self.features = torch.randn(n, m, 2048, generator=g).to(torch.float16)
        xy = torch.rand(n, m, 2, generator=g) * 0.5
        self.boxes = torch.cat([xy, xy + 0.1 + torch.rand(n, m, 2, generator=g) * 0.4], dim=-1)
        self.lengths = torch.randint(short, long + 1, (n,), generator=g).tolist()
        self.ids = torch.randint(5, p["vocab"], (n, long), generator=g)
        self.answers = torch.randint(0, p["answers"], (n,), generator=g).tolist()
        self.num_answers = p["answers"]

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids = self.ids[i, : self.lengths[i]]
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
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, fused=device.type == "cuda")
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, step / WARMUP_STEPS))
    return optimizer, warmup


def loss_of(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """VQA's logit_bce (mmvl's registered loss): BCE summed over answers, averaged over the batch."""
    return torch.nn.functional.binary_cross_entropy_with_logits(scores, targets.to(scores.dtype)) * targets.size(1)


def autocast(device: torch.device, precision: str):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()


class Clock:
    """Times a variant's updates after the first ``warmup``; runners call ``tick(update)`` after each.

    Alone (``baton=None``, the GPU default): the seconds from the end of update ``warmup`` to
    the end of the last one, after waiting for the device. Interleaved (the CPU default): the
    variants run in threads that take turns one update at a time (``Baton``), so a busy
    machine slows them all alike, and each update is timed on its own. ``process`` measures
    CPU seconds of this process instead of wall seconds (one thread: leaves out the time
    spent waiting for a core).
    """

    def __init__(self, device: torch.device, warmup: int, updates: int, kind: str = "wall",
                 baton: "Baton | None" = None, name: str = ""):
        self.device, self.warmup, self.last = device, warmup, warmup + updates
        self.now = time.process_time if kind == "process" else time.perf_counter
        self.baton, self.name = baton, name
        self.times: list[float] = []  # seconds per update
        self.start = 0.0

    def begin(self) -> None:
        self.start = self.now()

    def tick(self, update: int) -> None:
        if self.baton is None:
            if update in (self.warmup, self.last):
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                if update == self.warmup:
                    self.start = self.now()
                else:
                    self.times.append((self.now() - self.start) / (self.last - self.warmup))
            return
        if update > self.warmup:
            self.times.append(self.now() - self.start)
        if update < self.last:
            self.baton.pass_on(self.name)
            self.start = self.now()


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


def run_round(variants: list[str], p: dict[str, Any], args: argparse.Namespace, device: torch.device,
              tmp: str, interleave: bool) -> dict[str, list[float]]:
    """One round of every variant (in turns, or one after the other): per-update seconds of each."""
    from mmvl.utils.logger import setup_logging

    baton = Baton(variants) if interleave else None
    clocks = {v: Clock(device, p["warmup"], p["updates"], args.clock, baton, v) for v in variants}
    errors: dict[str, BaseException] = {}

    def work(v: str) -> None:
        if baton is not None:
            baton.wait(v)
        try:
            setup_logging(None, 1)  # quiet: warnings only (the Trainer sets up its own logging)
            clocks[v].begin()
            RUNNERS[v](p, args, device, clocks[v], os.path.join(tmp, v))
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors[v] = e
        finally:
            if baton is not None:
                baton.finish(v)

    if interleave:
        threads = [threading.Thread(target=work, args=(v,), name=f"step_speed-{v}") for v in variants]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for v in variants:
            free(device)
            work(v)
    if errors:
        v, e = next(iter(errors.items()))
        raise RuntimeError(f"variant {v} failed: {type(e).__name__}: {e}") from e
    return {v: c.times for v, c in clocks.items()}


# -- the variants: each trains warmup + updates updates, calling clock.tick(update) after each ---------------------
def run_plain(p, args, device, clock, tmp) -> None:
    model = new_model(p).to(device)
    if args.compile:
        model = torch.compile(model)
    optimizer, scheduler = new_optimizer(model, device)
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")
    model.train()
    batches = forever(loader(p, device))
    for update in range(1, clock.last + 1):
        batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in next(batches).items()}
        with autocast(device, args.precision):
            loss = loss_of(model(batch)["scores"], batch["targets"])
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        clock.tick(update)


def run_engine(p, args, device, clock, tmp) -> None:
    from mmvl.distributed.env import DistEnv
    from mmvl.engine import Engine

    engine = Engine(config(p, args, tmp, clock.last), env=DistEnv(device=device))
    model = new_model(p)
    optimizer, scheduler = new_optimizer(model, device)
    model, optimizer, data, scheduler = engine.prepare(model, optimizer, loader(p, device), scheduler)
    model.train()
    batches = forever(data)
    for update in range(1, clock.last + 1):
        batch = next(batches)
        with engine.accumulate(model):
            with engine.autocast():
                loss = loss_of(model(batch)["scores"], batch["targets"])
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        clock.tick(update)


def run_trainer(p, args, device, clock, tmp) -> None:
    from mmvl.trainers import Trainer
    from mmvl.trainers.callbacks import Callback

    trainer = Trainer(config(p, args, tmp, clock.last))

    class Tick(Callback):
        def on_update_end(self, info):
            clock.tick(trainer.update)

    trainer.callbacks.append(Tick(trainer))  # last: the update's callbacks are part of its time
    trainer.fit()


def run_accelerate(p, args, device, clock, tmp) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision={"fp32": "no"}.get(args.precision, args.precision),
                              cpu=device.type == "cpu")
    model = new_model(p)
    if args.compile:
        model = torch.compile(model)
    optimizer, scheduler = new_optimizer(model, device)
    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, loader(p, device), scheduler)
    model.train()
    batches = forever(data)
    for update in range(1, clock.last + 1):
        batch = next(batches)
        loss = loss_of(model(batch)["scores"], batch["targets"])
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        clock.tick(update)


def run_lightning(p, args, device, clock, tmp) -> None:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = new_model(p)
            if args.compile:
                self.model = torch.compile(self.model)

        def training_step(self, batch, batch_idx):
            return loss_of(self.model(batch)["scores"], batch["targets"])

        def configure_optimizers(self):
            optimizer, scheduler = new_optimizer(self.model, device)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    class Tick(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            clock.tick(trainer.global_step)

    precision = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}[args.precision]
    trainer = L.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, precision=precision,
                        max_steps=clock.last, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Tick()], default_root_dir=tmp,
                        num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(Module(), train_dataloaders=loader(p, device))


RUNNERS: dict[str, Callable[..., None]] = {"plain": run_plain, "engine": run_engine, "trainer": run_trainer,
                                            "accelerate": run_accelerate, "lightning": run_lightning}
PACKAGES = {"accelerate": "accelerate", "lightning": "lightning"}


# -- measuring and reporting --------------------------------------------------------------------------
def flops_per_sample(p: dict[str, Any], args: argparse.Namespace, device: torch.device) -> float:
    """Forward + backward FLOPs of one sample, counted once on one batch of the model (eager)."""
    from mmvl.utils.flops import count_flops

    model = new_model(p).to(device).train()
    data = synthetic(p)
    batch = collate([data[i] for i in range(p["batch"])])
    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}

    def update() -> None:
        with autocast(device, args.precision):
            loss = loss_of(model(batch)["scores"], batch["targets"])
        loss.backward()

    total = count_flops(update)
    del model
    return total / p["batch"]


def available(variant: str) -> str | None:
    """Why ``variant`` cannot run here (a missing optional package), or None."""
    package = PACKAGES.get(variant)
    if package is None:
        return None
    try:
        __import__(package)
    except ImportError:
        return f"{package} is not installed (pip install -e \".[bench]\")"
    return None


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of %(default)s")
    parser.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: the preset's)")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None)
    parser.add_argument("--warmup", type=int, default=None, help="untimed updates per run")
    parser.add_argument("--updates", type=int, default=None, help="timed updates per run")
    parser.add_argument("--repeats", type=int, default=None, help="alternating rounds (median reported)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model in every variant")
    parser.add_argument("--no-prefetch", action="store_true",
                        help="mmvl variants copy each batch when needed instead of one batch ahead (CUDA)")
    parser.add_argument("--clock", choices=("wall", "process"), default="wall",
                        help="process: CPU time of this process (CPU presets on a shared machine, with --threads 1)")
    parser.add_argument("--interleave", choices=("auto", "update", "run"), default="auto",
                        help="update: variants take turns every update (auto on CPU); run: one whole run after "
                             "another (auto on CUDA, where waiting for the device every update would distort it)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="peak TFLOP/s of the device for MFU")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    p = dict(PRESETS[args.preset])
    for key in ("warmup", "updates", "repeats", "precision", "device"):
        if getattr(args, key) is not None:
            p[key] = getattr(args, key)
    args.precision, args.device = p["precision"], p["device"]
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--preset {args.preset} runs on CUDA but none is visible; use --device cpu")
    if args.clock == "process" and (device.type == "cuda" or p["workers"]):
        parser.error("--clock process measures one process on the CPU: a CPU preset without DataLoader workers")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or "plain" not in variants:
        parser.error(f"--variants must include plain and name only {', '.join(VARIANTS)} (got {unknown or variants})")

    import mmvl  # noqa: F401  (registers visual_bert and logit_bce)
    from mmvl.utils.flops import mfu, peak_flops

    register_dataset(p)
    skipped = {v: why for v in variants if (why := available(v))}
    variants = [v for v in variants if v not in skipped]
    per_sample = flops_per_sample(p, args, device)
    peak = peak_flops(device, args.precision, args.peak_tflops)
    print(f"preset {args.preset}: visual_bert h{p['hidden']} x{p['layers']} layers, batch {p['batch']}, "
          f"text {p['text'][0]}-{p['text'][1]} tokens, {p['regions']} regions x 2048, {p['answers']} answers; "
          f"{device} {args.precision}{' compiled' if args.compile else ''}, {torch.get_num_threads()} CPU threads, "
          f"{args.clock} clock; "
          f"{per_sample / 1e9:.3g} GFLOPs per sample (forward + backward); peak "
          + (f"{peak / 1e12:.0f} TFLOP/s" if peak else "unknown (MFU n/a; --peak-tflops sets it)"), flush=True)
    for v, why in skipped.items():
        print(f"note: {v} skipped: {why}", flush=True)
    if args.no_prefetch:
        print("note: --no-prefetch: the Engine and Trainer copy each batch when it is needed", flush=True)

    interleave = args.interleave == "update" or (args.interleave == "auto" and device.type == "cpu")
    times: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(p["repeats"]):
            for v, t in run_round(variants, p, args, device, os.path.join(tmp, str(r)), interleave).items():
                times[v] += t
                print(f"round {r + 1}/{p['repeats']} {v:10s} {1000 * statistics.median(t):8.2f} ms/update",
                      file=sys.stderr, flush=True)
    medians = {v: statistics.median(t) for v, t in times.items()}
    how = "each update timed, the variants taking turns update by update" if interleave else "one after the other"
    print(f"\nmedian of {p['repeats']} rounds x {p['updates']} timed updates (after {p['warmup']} untimed; {how}):")
    for v in variants:
        sps = p["batch"] / medians[v]
        util = mfu(per_sample, sps, peak)
        shown = f"{100 * util:.1f}%" if util is not None else "n/a"
        print(f"{v}: {1000 * medians[v]:.1f} ms/update, {sps:.0f} samples/s, MFU {shown}, "
              f"{medians[v] / medians['plain']:.3f}x plain")
    return medians


if __name__ == "__main__":
    main()
