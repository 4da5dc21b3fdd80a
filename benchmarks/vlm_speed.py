"""mmvl's VLM training step against the loop a user writes by hand with transformers (and peft for
LoRA), same model, batches and optimizer, one process; full fine-tuning and LoRA.

    python benchmarks/vlm_speed.py                                     # CPU: a 4-layer Llama of width 256, batch 16
    python benchmarks/vlm_speed.py --steps 1 --rounds 1 --batch 2 --width 32 --layers 1   # a smoke run

The model is mmvl's ``vlm`` (a CNN image encoder, an MLP projector, a random transformers Llama);
both sides train copies of the same initial weights on the same synthetic batches (64 x 64 images,
16 image tokens, prompts and answers of random lengths, right-padded) with AdamW. mmvl's step is
``Trainer.train_step`` itself (the ``answer_tokens`` loss over the whole update, backward and the
optimizer step through the Engine). The plain step is what a LLaVA-style script does: the image
tokens spliced into the LM's input embeddings, ``lm(inputs_embeds=..., labels=...)`` (transformers'
own shifted cross entropy), ``loss.backward()``, ``optimizer.step()``. For ``lora`` both models get
peft adapters of rank ``--rank`` on every linear layer of the LM (mmvl's ``lora`` key; peft's
``inject_adapter_in_model`` for the plain side) and only the adapters and the projector train.
The two alternate for ``--rounds`` rounds (each round starting with the other), each timing
``--steps`` updates after an untimed one; ``ratio`` is the median over rounds of mmvl's time over
the plain one's (target: at most 1.05), with tokens/s of each. Without peft installed the LoRA
comparison is left out (a ``note:`` line says so).
"""
from __future__ import annotations

import argparse
import importlib.util
import copy
import os
import statistics
import sys
from types import SimpleNamespace
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.timing import timed  # noqa: E402  (the tree first on sys.path)
IMAGE_TOKEN, PAD, EOS, IGNORE = 3, 0, 2, -100


def vlm(args: argparse.Namespace, lora: bool) -> torch.nn.Module:
    from omegaconf import OmegaConf

    from mmvl.adapters import apply_lora
    from mmvl.models.vlm import VLM

    torch.manual_seed(0)
    model = VLM(OmegaConf.create({
        "vocab_size": args.vocab, "image_token_id": IMAGE_TOKEN, "pad_token_id": PAD, "eos_token_id": EOS,
        "image_encoder": {"type": "cnn", "params": {"channels": [32, 64, 64], "strides": [2, 2, 2]}},
        "pixel_shuffle": 2, "projector_layers": 2, "generation": {"max_new_tokens": 4, "num_beams": 1},
        "language_model": {"path": None, "attn_implementation": "sdpa", "random": {
            "model_type": "llama", "hidden_size": args.width, "intermediate_size": 2 * args.width,
            "num_hidden_layers": args.layers, "num_attention_heads": args.heads, "max_position_embeddings": 256}}}))
    if lora:
        apply_lora(model, {"r": args.rank, "alpha": 2 * args.rank, "dropout": 0.0, "target_modules": ["all-linear"],
                           "parts": ["language_model"]}, "vlm")
        model.image_encoder.requires_grad_(False)
    return model


def batches(args: argparse.Namespace, n: int) -> list[dict[str, torch.Tensor]]:
    """``[bos] <image> x 16  prompt  answer [eos]``, right-padded; targets the answer and its end."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        lengths = torch.randint(args.length // 2, args.length - 16, (args.batch,), generator=g)
        ids = torch.full((args.batch, args.length), PAD)
        targets = torch.full((args.batch, args.length), IGNORE)
        for row, text in enumerate(lengths.tolist()):
            words = torch.randint(4, args.vocab, (text,), generator=g)
            answer = max(1, text // 4)
            ids[row, 0], ids[row, 1:17] = 1, IMAGE_TOKEN
            ids[row, 17:17 + text] = words
            ids[row, 17 + text - 1] = EOS
            targets[row, 17 + text - answer:17 + text] = ids[row, 17 + text - answer:17 + text]
        out.append({"input_ids": ids, "attention_mask": ids.ne(PAD).long(), "targets": targets,
                    "image": torch.randn(args.batch, 3, 64, 64, generator=g)})
    return out


def optimizer_of(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0)


class MmvlStep:
    """``Trainer.train_step`` on a shell holding just what it reads (no config, datasets or callbacks)."""

    def __init__(self, model: torch.nn.Module, data: list[dict[str, torch.Tensor]]):
        from mmvl.engine import Engine
        from mmvl.losses import build_losses
        from mmvl.trainers.finite import NonFiniteGuard
        from mmvl.trainers.trainer import Trainer
        from mmvl.utils.flops import FlopCount

        engine = Engine(device="cuda" if torch.cuda.is_available() else "cpu")
        model, optimizer = engine.prepare(model, optimizer_of(model))
        shell = SimpleNamespace(engine=engine, model=model, optimizer=optimizer, losses=build_losses(["answer_tokens"]),
                                cached_contrast=False, flops=FlopCount(), clip_grad_norm=None, scheduler=None,
                                nonfinite=NonFiniteGuard(engine.all_reduce), state=SimpleNamespace(update=0),
                                env=SimpleNamespace(world_size=1), batch_size=len(data[0]["input_ids"]))
        shell.flops.total = 0  # not counted
        shell._micro_step = lambda batch: Trainer._micro_step(shell, batch)
        shell._whole_update = lambda micro: Trainer._whole_update(shell, micro)
        self.shell, self.step, self.data = shell, Trainer.train_step, data

    def run(self, n: int) -> None:
        self.shell.train_data = iter(self.data[:n])
        for _ in range(n):
            self.step(self.shell)


class PlainStep:
    """A hand-written loop: splice the image tokens, transformers' loss, backward, step."""

    def __init__(self, model: torch.nn.Module, data: list[dict[str, torch.Tensor]]):
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model, self.optimizer = model.to(device).train(), optimizer_of(model)
        self.data = [{k: v.to(device) for k, v in b.items()} for b in data]

    def run(self, n: int) -> None:
        m = self.model
        for batch in self.data[:n]:
            ids = batch["input_ids"]
            embeds = m.lm.get_input_embeddings()(ids.masked_fill(ids.eq(IMAGE_TOKEN), 0))
            image = m.image_tokens(batch["image"])  # the same encoder, pixel shuffle and projector
            embeds = embeds.masked_scatter(ids.eq(IMAGE_TOKEN).unsqueeze(-1), image.to(embeds.dtype))
            loss = m.lm(inputs_embeds=embeds, attention_mask=batch["attention_mask"], labels=batch["targets"]).loss
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()


def interleaved(steps: dict[str, Any], data: list[dict[str, Any]], args: argparse.Namespace, kind: str,
                label: str = "") -> float:
    """``steps["mmvl"]`` and ``steps["plain"]`` timed in alternating order over ``args.rounds`` rounds of
    ``args.steps`` updates after an untimed one; prints each side's median and the median ratio."""
    for step in steps.values():
        step.run(1)  # warm-up: allocator, optimizer state
    times: dict[str, list[float]] = {k: [] for k in steps}
    for r in range(args.rounds):
        for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            times[name].append(timed(steps[name], args.steps))
    tokens = sum(int(b["attention_mask"].sum()) for b in data) / len(data)
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{kind} {name}: {1000 * median:.1f} ms/update, {tokens / median:.0f} tokens/s")
    ratio = statistics.median(m / p for m, p in zip(times["mmvl"], times["plain"]))
    print(f"ratio {kind} {label}mmvl/plain: {ratio:.3f} (target: at most 1.05)")
    return ratio


def compare(args: argparse.Namespace, lora: bool) -> float:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = batches(args, args.steps)
    model = vlm(args, lora)
    steps = {"mmvl": MmvlStep(copy.deepcopy(model).to(device), data), "plain": PlainStep(copy.deepcopy(model), data)}
    return interleaved(steps, data, args, "lora" if lora else "full")


def arguments(doc: str, batch: int, length: int, image_tokens: int) -> argparse.ArgumentParser:
    """The options both VLM step benchmarks take (``batch`` and ``length``: their defaults)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed updates per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--length", type=int, default=length, help=f"tokens per sample with the {image_tokens} "
                        "image tokens")
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return parser


def both(compare_one: Any) -> None:
    """``compare_one(lora)`` for full fine-tuning, then LoRA where peft is installed."""
    compare_one(False)
    if importlib.util.find_spec("peft") is None:  # a GPU machine without a package index may lack it
        print("note: peft is not installed: the LoRA comparison is left out")
    else:
        compare_one(True)


def main() -> None:
    args = arguments(__doc__, batch=16, length=64, image_tokens=16).parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    both(lambda lora: compare(args, lora))


if __name__ == "__main__":
    main()
