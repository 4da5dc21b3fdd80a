"""mmvl's clip training step against open_clip's own, same model and batches, one process; and the
memory the clip loss keeps for backward at batch 4,096 with and without ``local_loss``.

    python benchmarks/contrastive_speed.py                    # CPU: ResNet-18 at 64 px, 4-layer text, batch 64
    python benchmarks/contrastive_speed.py --steps 2 --rounds 1 --batch 8 --loss-batch 256   # a smoke run

The model is open_clip's ``CLIP`` (a timm image tower and open_clip's text transformer), random
initialised; mmvl's ``clip`` loads its state dict (``open_clip_weights``), so both train the same
weights on the same synthetic batches with AdamW. mmvl's step is ``Trainer.train_step`` itself
(forward, the ``clip`` loss, backward, optimizer step, through the Engine); open_clip's is
``open_clip_train.train.train_one_epoch`` with its ``ClipLoss`` over the same batches. The two run
alternately for ``--rounds`` rounds (each round starting with the other), each timing ``--steps``
updates after one untimed update; ``time ratio mmvl/open_clip`` is the median over the rounds of
the two times' ratio (target: at most 1.05), robust to a busy machine slowing a whole round.
Peak memory is the device's (CUDA); on a CPU it is not measured and printed as n/a. Where open_clip
is not installed (a GPU machine without a package index), mmvl's step is timed alone, from the
same random initialisation, and a ``note:`` line says there is no ratio.

The loss memory part runs 2 gloo ranks of ``--loss-batch``/2 rows each (global ``--loss-batch``):
the bytes the loss saves for backward (its logits, log-softmax, gathered features), summed by
``torch.autograd.graph.saved_tensors_hooks``, per rank, with ``local_loss`` false and true;
``--loss-batch 0`` leaves that part out.
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import statistics
import sys
import tempfile
from types import SimpleNamespace
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.timing import timed  # noqa: E402  (the tree first on sys.path)


def open_clip_model(args: argparse.Namespace) -> torch.nn.Module:
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

    torch.manual_seed(0)
    return CLIP(args.embed, vision_cfg=CLIPVisionCfg(timm_model_name=args.timm, timm_model_pretrained=False,
                                                     timm_pool="avg", timm_proj="linear", image_size=args.image),
                text_cfg=CLIPTextCfg(context_length=args.context, vocab_size=args.vocab, width=args.width,
                                     heads=args.heads, layers=args.layers), output_dict=True)


def mmvl_model(args: argparse.Namespace, weights: str | None) -> torch.nn.Module:
    from omegaconf import OmegaConf

    from mmvl.models.clip import Clip

    return Clip(OmegaConf.create({
        "vocab_size": args.vocab, "embed_dim": args.embed, "init_logit_scale": 0.0, "init_logit_bias": None,
        "image_encoder": {"type": "timm", "params": {"model_name": args.timm, "global_pool": "avg"}},
        "text_encoder": {"type": "transformer", "width": args.width, "layers": args.layers, "heads": args.heads,
                         "context_length": args.context},
        "open_clip_weights": weights}))


def batches(args: argparse.Namespace, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Images and open_clip-style texts: tokens, the end-of-text (highest) id, zero padding."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        images = torch.randn(args.batch, 3, args.image, args.image, generator=g)
        lengths = torch.randint(4, args.context, (args.batch,), generator=g)
        texts = torch.randint(1, args.vocab - 1, (args.batch, args.context), generator=g)
        texts[torch.arange(args.batch), lengths - 1] = args.vocab - 1
        texts[torch.arange(args.context)[None, :] >= lengths[:, None]] = 0
        out.append((images, texts))
    return out


def optimizer_of(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)


class MmvlStep:
    """``Trainer.train_step`` on a shell holding just what it reads (no config, datasets or callbacks)."""

    def __init__(self, model: torch.nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]):
        from mmvl.engine import Engine
        from mmvl.losses import build_losses
        from mmvl.trainers.finite import NonFiniteGuard
        from mmvl.trainers.trainer import Trainer
        from mmvl.utils.flops import FlopCount

        engine = Engine(device="cpu" if not torch.cuda.is_available() else "cuda")
        model, optimizer = engine.prepare(model, optimizer_of(model))
        shell = SimpleNamespace(engine=engine, model=model, optimizer=optimizer, losses=build_losses(["clip"]),
                                cached_contrast=False, flops=FlopCount(), clip_grad_norm=None, scheduler=None,
                                nonfinite=NonFiniteGuard(engine.all_reduce), state=SimpleNamespace(update=0),
                                env=SimpleNamespace(world_size=1), batch_size=len(data[0][0]))
        shell.flops.total = 0  # not counted
        shell._micro_step = lambda batch: Trainer._micro_step(shell, batch)
        self.shell, self.step = shell, Trainer.train_step
        self.data = [{"image": i, "input_ids": t, "attention_mask": (t != 0).long()} for i, t in data]

    def run(self, n: int) -> None:
        self.shell.train_data = iter(self.data[:n])
        for _ in range(n):
            self.step(self.shell)


class OpenClipStep:
    """``open_clip_train.train.train_one_epoch`` over ``n`` of the batches, as its training script runs it."""

    def __init__(self, model: torch.nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]):
        from open_clip.loss import ClipLoss

        self.model, self.data, self.loss = model, data, ClipLoss()
        self.optimizer = optimizer_of(model)
        self.args = SimpleNamespace(device="cuda" if torch.cuda.is_available() else "cpu", precision="fp32",
                                    distill=False, accum_freq=1, skip_scheduler=True, horovod=False,
                                    grad_clip_norm=None, log_every_n_steps=10 ** 9, rank=0, local_rank=0,
                                    world_size=1, batch_size=len(data[0][0]), wandb=False)
        self.epoch = 0

    def run(self, n: int) -> None:
        from open_clip_train.train import train_one_epoch

        loader = _Loader(self.data[:n])
        train_one_epoch(self.model, {"train": SimpleNamespace(dataloader=loader, set_epoch=lambda e: None)},
                        self.loss, self.epoch, self.optimizer, None, None, None, self.args)
        self.epoch += 1


class _Loader(list):
    """A list of batches with the two counters open_clip's loop reads."""

    @property
    def num_batches(self) -> int:
        return len(self)

    @property
    def num_samples(self) -> int:
        return sum(len(b[0]) for b in self)


def speed(args: argparse.Namespace) -> float | None:
    """The interleaved timing; the ratio, or None where open_clip is not installed (mmvl alone)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = [(i.to(device), t.to(device)) for i, t in batches(args, args.steps)]
    if importlib.util.find_spec("open_clip") is None:
        print("note: open_clip is not installed: mmvl's step is timed alone, no ratio")
        torch.manual_seed(0)
        steps: dict[str, Any] = {"mmvl": MmvlStep(mmvl_model(args, None).to(device), data)}
    else:
        reference = open_clip_model(args)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "open_clip.pt")
            torch.save(reference.state_dict(), path)
            ours = mmvl_model(args, path)
        steps = {"mmvl": MmvlStep(ours.to(device), data), "open_clip": OpenClipStep(reference.to(device), data)}
    times: dict[str, list[float]] = {k: [] for k in steps}
    peaks: dict[str, float | None] = {k: None for k in steps}
    for name, step in steps.items():
        step.run(1)  # warm-up: allocator, optimizer state
    for r in range(args.rounds):
        for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):  # alternate who goes first
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            times[name].append(timed(steps[name], args.steps))
            if torch.cuda.is_available():
                peaks[name] = max(peaks[name] or 0.0, torch.cuda.max_memory_allocated() / 2 ** 20)
    median = {k: statistics.median(v) for k, v in times.items()}
    for name in steps:
        peak = f"{peaks[name]:.0f} MB" if peaks[name] is not None else "n/a (CPU)"
        print(f"{name}: {1000 * median[name]:.1f} ms/update, {args.batch / median[name]:.1f} samples/s, "
              f"peak memory {peak}")
    if "open_clip" not in steps:
        return None
    ratio = statistics.median(m / o for m, o in zip(times["mmvl"], times["open_clip"]))  # round by round
    memory = f", peak memory ratio {peaks['mmvl'] / peaks['open_clip']:.3f}" if peaks["mmvl"] else ""
    print(f"time ratio mmvl/open_clip: {ratio:.3f} (target: at most 1.05){memory}")
    return ratio


def _loss_memory(env: Any, rows: int, dim: int) -> dict[bool, int]:
    from mmvl.losses import ClipLoss

    g = torch.Generator().manual_seed(env.rank)
    out = {}
    for local in (False, True):
        image = torch.nn.functional.normalize(torch.randn(rows, dim, generator=g), dim=-1).requires_grad_(True)
        text = torch.nn.functional.normalize(torch.randn(rows, dim, generator=g), dim=-1).requires_grad_(True)
        saved: dict[int, int] = {}  # storage address -> bytes: a tensor saved twice (or a view) counts once

        def keep(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            loss = ClipLoss(local_loss=local)({}, {"image_features": image, "text_features": text,
                                                   "logit_scale": torch.tensor(10.0)})
        loss.backward()
        out[local] = sum(saved.values())
    return out


def loss_memory(args: argparse.Namespace) -> None:
    sys.path.insert(0, os.path.join(ROOT, "tests", "distributed"))
    from dist_launch import launch

    ranks = launch(_loss_memory, world_size=2, args=(args.loss_batch // 2, args.embed_loss), timeout=600)
    full, local = (max(r[flag] for r in ranks) for flag in (False, True))
    print(f"clip loss at batch {args.loss_batch} over 2 ranks, saved for backward per rank: "
          f"{full / 2 ** 20:.1f} MB global, {local / 2 ** 20:.1f} MB local_loss ({local / full:.3f}x)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--timm", default="resnet18")
    parser.add_argument("--image", type=int, default=64)
    parser.add_argument("--embed", type=int, default=128)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--loss-batch", type=int, default=4096, help="0: no loss-memory part")
    parser.add_argument("--embed-loss", type=int, default=512)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger().setLevel(logging.WARNING)  # open_clip's loop logs its first update
    speed(args)
    if args.loss_batch:
        loss_memory(args)


if __name__ == "__main__":
    main()
