"""Where ``training.packing``'s time goes against grouping: the language model alone, forward and
backward, on one epoch's batches of each side, so that the data pipeline, the image encoder and the
optimizer (and their noise) stay out of the comparison.

    python benchmarks/packing_lm.py                  # easy-VQA conversations
    python benchmarks/packing_lm.py --set llava      # the LLaVA-style set of benchmarks/packing.py
    python benchmarks/packing_lm.py --updates 1 --rounds 1 --smoke --batch 4   # a smoke run

The two Trainers of ``benchmarks/packing.py`` (grouped, packed; the same seed, so the same initial
weights) each draw one epoch, the same samples; each batch is embedded once (images spliced in) and
then only the language model runs, with a stand-in loss (the logits' mean square, the same work for
all). Three ways, in turns of ``--updates`` batches (the order rotating), over ``--rounds`` epochs:

- ``grouped``: grouping's padded batches, as the Trainer runs them;
- ``one-bucket``: the same padded batches through packed attention
  (:mod:`mmvl.models.modules.segment_attention`), each batch one bucket of its rows (padding
  included, positions as grouping's): grouping's own work, on packing's path;
- ``packed``: the packed rows, as the Trainer runs them.

``one-bucket/grouped`` is what packing's path costs on the same work; ``packed/one-bucket`` what
splitting a micro-batch of spread lengths into buckets costs, net of the padding it saves. Printed:
each way's milliseconds a batch, and the lines ``one-bucket/grouped time R`` and
``packed/grouped time R`` (ratios of time over the same samples: above 1 is slower).
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.group_by_length import parsed, trainer_arguments  # noqa: E402  (the tree first on sys.path)
from benchmarks.packing import build, write_llava  # noqa: E402
from benchmarks.timing import drained  # noqa: E402


def epoch_inputs(steps: Any) -> tuple[Any, list[tuple[torch.Tensor, dict[str, Any]]]]:
    """One epoch of the side's batches as its language model takes them: (embeddings that take a
    gradient, the other keyword arguments). Returns the model's LM with them."""
    from mmvl.models.modules.vlm_parts import lm_packed_inputs

    trainer = steps.trainer
    model = getattr(trainer.model, "module", trainer.model)
    out = []
    for _ in range(steps.stream.batches_per_epoch):
        batch = trainer.engine.to_device(next(steps.stream))
        packed = batch.get("position_ids") is not None
        with torch.no_grad():
            embeds = model.embed(batch["input_ids"], batch["image"], in_order=packed)
        extra = (lm_packed_inputs(model.lm.config, batch, embeds.dtype) if packed
                 else {"attention_mask": batch.get("attention_mask")})
        out.append((embeds.requires_grad_(), extra))
    return model.lm, out


def one_bucket(lm: Any, padded: list[tuple[torch.Tensor, dict[str, Any]]]) -> list[tuple[torch.Tensor, dict[str, Any]]]:
    """Padded batches as packed rows of one bucket each: every row a sample of the batch's width (its
    padding computed, as grouping computes it), positions 0.. a row, as the padded batch has them."""
    from mmvl.data.packing import attention_buckets
    from mmvl.data.sample import to_device
    from mmvl.models.modules.vlm_parts import lm_packed_inputs

    out = []
    for embeds, _ in padded:
        rows, width, hidden = embeds.shape
        segments = attention_buckets([(r * width, width) for r in range(rows)], rows * width)
        if len(segments["shapes"]) != 1:
            raise SystemExit(f"rows of one width made {len(segments['shapes'])} buckets, not one")
        rows_batch = {"position_ids": torch.arange(width).repeat(rows).unsqueeze(0), "segments": segments}
        extra = lm_packed_inputs(lm.config, to_device(rows_batch, embeds.device), embeds.dtype)
        out.append((embeds.detach().reshape(1, rows * width, hidden).requires_grad_(), extra))
    return out


def run(lm: Any, inputs: list[tuple[torch.Tensor, dict[str, Any]]]) -> float:
    """Seconds of forward and backward of ``lm`` over ``inputs``."""
    drained()
    start = time.perf_counter()
    for embeds, extra in inputs:
        lm(inputs_embeds=embeds, use_cache=False, **extra).logits.float().square().mean().backward()
        embeds.grad = None  # not accumulated over the rounds: each backward the same work
    drained()
    return time.perf_counter() - start


def measure(name: str, data: list[str], args: Any, tmp: str) -> None:
    sides = {side: build(side, args, data, os.path.join(tmp, f"{name}_{side}")) for side in ("grouped", "packed")}
    grouped_lm, grouped = epoch_inputs(sides["grouped"])
    packed_lm, packed = epoch_inputs(sides["packed"])
    ways = {"grouped": (grouped_lm, grouped), "one-bucket": (packed_lm, one_bucket(packed_lm, grouped)),
            "packed": (packed_lm, packed)}
    if len({len(inputs) for _, inputs in ways.values()}) != 1:
        raise SystemExit(f"set {name}: the sides' epochs differ in length; the comparison needs the same samples")
    for lm, inputs in ways.values():
        run(lm, inputs[:1])  # untimed: first-call work
    seconds = dict.fromkeys(ways, 0.0)
    batches, r = len(grouped), 0
    for _ in range(args.rounds):
        for at in range(0, batches, args.updates):
            names = list(ways)[r % len(ways):] + list(ways)[: r % len(ways)]
            for way in names:
                lm, inputs = ways[way]
                seconds[way] += run(lm, inputs[at: at + args.updates])
                lm.zero_grad(set_to_none=True)
            r += 1
    print(f"set {name}: {batches} batches a way, {args.rounds} epoch(s), language model forward and backward")
    for way, took in seconds.items():
        print(f"  {way}: {1e3 * took / (batches * args.rounds):.1f} ms/batch")
    for way in ("one-bucket", "packed"):
        print(f"{way}/grouped time {seconds[way] / seconds['grouped']:.3f}")


def main() -> int:
    parser = trainer_arguments(__doc__, updates=5)
    parser.set_defaults(rounds=2)
    parser.add_argument("--set", choices=["easy_vqa", "llava"], default="easy_vqa")
    parser.add_argument("--packing-length", type=int, default=0, help="rows' tokens (0: one row a micro-batch)")
    args = parsed(parser)
    with tempfile.TemporaryDirectory() as tmp:
        if args.set == "easy_vqa":
            measure("easy_vqa_conversations", [], args, tmp)
        else:
            measure("llava", write_llava(os.path.join(tmp, "llava_data"), n=400 if args.smoke else 1200), args, tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
