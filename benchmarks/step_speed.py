"""Time per update of one model under a plain PyTorch loop, mmvl's Engine, mmvl's Trainer,
Accelerate and Lightning: same model, data, optimizer and precision, one process.

    python benchmarks/step_speed.py --preset small            # CPU, 2-layer h256
    python benchmarks/step_speed.py --preset base --compile   # GPU, BERT-base, batch 128, bf16
    python benchmarks/step_speed.py --preset small --threads 1 --clock process   # a busy CPU

The model is the registered ``visual_bert`` on region features (``feature_dim: 2048``,
boxes, a 3,129-answer VQA head with ``logit_bce``); the data are synthetic region
features (fp16) and token ids of one fixed length per preset (no padding, so every
batch has the same shapes and a compiled model has no reason to recompile while it is
timed; the recompiles seen are printed), held in host memory and served through a
DataLoader, the way real batches arrive. Every variant trains with AdamW (fused where torch has the kernels)
and a linear warm-up schedule; the variants run alternately (``--repeats`` rounds), each
for ``--warmup`` untimed updates and then ``--updates`` timed ones, each round starting with the
next variant (the first of a turn runs faster on a busy CPU), and the median per
variant is reported: ms/update, samples/s, MFU (printed with its formula: FLOPs of one
update counted once with ``torch.utils.flop_counter``; peak FLOP/s from mmvl's table of
GPUs, e.g. the 989 TFLOP/s bf16 spec of H100/H200, or ``--peak-tflops``) and the ratio to
the plain loop. With ``--compile`` the model's graph breaks are printed first (Dynamo in training
mode, forward + loss, ``mmvl.utils.compile.graph_breaks``; 0 expected). The Engine variant is
Accelerate's loop ported to mmvl: one loop function, ``accelerate_loop``, run with ``Accelerator``
imported from ``mmvl.engine`` (the Engine) or from ``accelerate``, nothing else differing; its ratio to the plain loop is printed before the summary
(the Engine's target: within 1.02x). The mmvl Trainer runs with its default callbacks (logging every
``training.log_interval``, checkpoint and preemption checks); Accelerate and Lightning
come from the optional ``bench`` extra (``pip install -e ".[bench]"``) and are skipped
with a note when missing. Lightning runs without logger, checkpointing, progress bar and
model summary (none of them is part of an update). Shared parts: ``step_speed_setup.py``.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import threading
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # step_speed_setup, also when imported
from step_speed_setup import (PRESETS, ROOT, Baton, Clock, autocast, config, flops_per_sample,  # noqa: E402,F401
                              forever, loader, loss_of, model_graph_breaks, model_options, new_model, new_optimizer,
                              register_dataset)

VARIANTS = ("plain", "engine", "trainer", "accelerate", "lightning")
def run_round(variants: list[str], p: dict[str, Any], args: argparse.Namespace, device: torch.device,
              tmp: str, interleave: bool) -> dict[str, Clock]:
    """One round of every variant (in turns, or one after the other): each one's clock (times, recompiles)."""
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
    return clocks


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


def run_trainer(p, args, device, clock, tmp) -> None:
    from mmvl.trainers import Trainer
    from mmvl.trainers.callbacks import Callback

    trainer = Trainer(config(p, args, tmp, clock.last))

    class Tick(Callback):
        def on_update_end(self, info):
            clock.tick(trainer.update)

    trainer.callbacks.append(Tick(trainer))  # last: the update's callbacks are part of its time
    trainer.fit()


def accelerate_loop(Accelerator, p, args, device, clock) -> None:
    """Accelerate's loop as its users write it (prepare, backward, step); the Engine variant runs this
    same text with ``Accelerator`` imported from ``mmvl.engine`` instead of ``accelerate``."""
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


def run_engine(p, args, device, clock, tmp) -> None:
    from mmvl.engine import Accelerator

    accelerate_loop(Accelerator, p, args, device, clock)


def run_accelerate(p, args, device, clock, tmp) -> None:
    from accelerate import Accelerator

    accelerate_loop(Accelerator, p, args, device, clock)


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
    from mmvl.utils.flops import peak_flops

    register_dataset(p)
    skipped = {v: why for v in variants if (why := available(v))}
    variants = [v for v in variants if v not in skipped]
    per_sample = flops_per_sample(p, args, device)
    peak = peak_flops(device, args.precision, args.peak_tflops)
    print(f"preset {args.preset}: visual_bert h{p['hidden']} x{p['layers']} layers, batch {p['batch']}, "
          f"text {p['text']} tokens (no padding), {p['regions']} regions x 2048, {p['answers']} answers; "
          f"{device} {args.precision}{' compiled' if args.compile else ''}, {torch.get_num_threads()} CPU threads, "
          f"{args.clock} clock; "
          f"{per_sample / 1e9:.3g} GFLOPs per sample (forward + backward); peak "
          + (f"{peak / 1e12:.0f} TFLOP/s" if peak else "unknown (MFU n/a; --peak-tflops sets it)"), flush=True)
    if args.compile:  # each break is a return to Python per update in every compiled variant
        breaks = model_graph_breaks(p, args, device)
        print(f"graph breaks (Dynamo, training mode, forward + loss; 0 expected): visual_bert {len(breaks)}"
              + "".join(f"\n  break: {reason}" for reason in breaks), flush=True)
    for v, why in skipped.items():
        print(f"note: {v} skipped: {why}", flush=True)
    if args.no_prefetch:
        print("note: --no-prefetch: the Trainer copies each batch when it is needed (the Engine variant is "
              "Accelerate's loop, with the Engine's default)", flush=True)

    interleave = args.interleave == "update" or (args.interleave == "auto" and device.type == "cpu")
    times: dict[str, list[float]] = {v: [] for v in variants}
    recompiles = dict.fromkeys(variants, 0)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(p["repeats"]):
            # each round starts with the next variant: on a busy CPU the first of each turn runs measurably
            # faster (0.96x plain for the Engine first, 1.03x second, same code), so no variant keeps a place
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for v, clock in run_round(order, p, args, device, os.path.join(tmp, str(r)), interleave).items():
                times[v] += clock.times
                recompiles[v] += clock.recompiles
                print(f"round {r + 1}/{p['repeats']} {v:10s} {1000 * statistics.median(clock.times):8.2f} ms/update",
                      file=sys.stderr, flush=True)
    medians = {v: statistics.median(t) for v, t in times.items()}
    report(p, args, variants, medians, recompiles, per_sample, peak, interleave)
    return medians


def report(p: dict[str, Any], args: argparse.Namespace, variants: list[str], medians: dict[str, float],
           recompiles: dict[str, int], per_sample: float, peak: float | None, interleave: bool) -> None:
    """The formula, the recompiles while timed, then one summary line per variant (the output's last lines)."""
    from mmvl.utils.flops import mfu

    how = "each update timed, the variants taking turns update by update" if interleave else "one after the other"
    print(f"\nmedian of {p['repeats']} rounds x {p['updates']} timed updates (after {p['warmup']} untimed; {how}):")
    shown_peak = (f"{peak / 1e12:.1f} TFLOP/s (the {args.precision} spec peak of this device, or --peak-tflops)"
                  if peak else f"no peak known for {args.device} {args.precision} (--peak-tflops sets one), so MFU n/a")
    print(f"MFU = FLOPs per sample x samples/s / peak FLOP/s = {per_sample / 1e9:.4g} GFLOP x samples/s / "
          f"{shown_peak}")
    if args.compile:
        counts = ", ".join(f"{v} {recompiles[v]}" for v in variants)
        print(f"recompiles while timed (torch._dynamo counters['frames']['total']; 0 expected): {counts}")
        if any(recompiles.values()):
            print("note: a variant compiled while it was timed; its figure includes compile time", flush=True)
    if "engine" in medians:
        print(f"the ported Accelerate loop on the Engine against the plain loop, same process: "
              f"{medians['engine'] / medians['plain']:.3f}x (target: at most 1.02x)")
    for v in variants:
        sps = p["batch"] / medians[v]
        util = mfu(per_sample, sps, peak)
        shown = f"{100 * util:.1f}%" if util is not None else "n/a"
        print(f"{v}: {1000 * medians[v]:.1f} ms/update, {sps:.0f} samples/s, MFU {shown}, "
              f"{medians[v] / medians['plain']:.3f}x plain")


if __name__ == "__main__":
    main()
