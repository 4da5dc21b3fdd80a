"""mmvl's training step on a released VLM (``model: hf_vlm``) against the loop a user writes by hand with
transformers (and peft for LoRA): the same model, batches and optimizer, one process; full fine-tuning
and LoRA.

    python benchmarks/hf_vlm_speed.py                         # CPU: a LLaVA of a 4-layer Llama of width 256
    python benchmarks/hf_vlm_speed.py --steps 1 --rounds 1 --batch 2 --width 32 --layers 1   # a smoke run

The model is a random LLaVA (a CLIP vision tower, the 2-layer projector, a Llama) written to a
temporary folder by ``save_pretrained`` and loaded by ``hf_vlm`` as any released folder is; both sides
train copies of the same weights on the same synthetic batches (64 x 64 images, 64 image tokens, text
of random lengths, right-padded, the answer labelled) with AdamW. mmvl's step is
``Trainer.train_step`` itself (see ``vlm_speed.py``); the plain step is ``model(**inputs,
labels=...).loss.backward()`` and ``optimizer.step()`` on the transformers model. With ``lora`` both get
peft adapters of rank ``--rank`` on every linear layer of the language model (mmvl's ``lora`` key;
peft's ``inject_adapter_in_model`` on the plain side), the vision tower is frozen and the projector
trains. Rounds alternate which side goes first; ``ratio`` is the median of mmvl's time over the plain
one's (target: at most 1.05).
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.vlm_speed import MmvlStep, arguments, both, interleaved, optimizer_of  # noqa: E402  (the tree first)

IMAGE_TOKEN, PAD, EOS, IGNORE = 3, 0, 2, -100


def llava_folder(args: argparse.Namespace, folder: str) -> str:
    """A random LLaVA written where ``hf_vlm`` reads released ones from."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    vision = CLIPVisionConfig(hidden_size=args.vision_width, intermediate_size=2 * args.vision_width,
                              num_hidden_layers=2, num_attention_heads=2, image_size=64, patch_size=8)
    text = LlamaConfig(vocab_size=args.vocab, hidden_size=args.width, intermediate_size=2 * args.width,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads, max_position_embeddings=512,
                       pad_token_id=PAD, eos_token_id=EOS)
    LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
                                              vision_feature_select_strategy="default")).save_pretrained(folder)
    return folder


def hf_vlm(folder: str, args: argparse.Namespace, lora: bool) -> torch.nn.Module:
    from omegaconf import OmegaConf

    from mmvl.adapters import apply_lora
    from mmvl.models.hf_vlm import HFVLM

    model = HFVLM(OmegaConf.create({"path": folder, "attn_implementation": "sdpa", "eos_token_id": EOS,
                                    "pad_token_id": PAD, "processor": folder,
                                    "generation": {"max_new_tokens": 4, "num_beams": 1}}))
    if lora:
        apply_lora(model, {"r": args.rank, "alpha": 2 * args.rank, "dropout": 0.0, "target_modules": ["all-linear"],
                           "parts": ["language_model"]}, "hf_vlm")
        model.freeze(["vision"])
    return model


def batches(args: argparse.Namespace, n: int) -> list[dict[str, Any]]:
    """``<image> x 64  text``, right-padded; the last quarter of the text (its answer) labelled."""
    g = torch.Generator().manual_seed(1)
    image_tokens = (64 // 8) ** 2
    out = []
    for _ in range(n):
        ids = torch.full((args.batch, args.length), PAD)
        targets = torch.full((args.batch, args.length), IGNORE)
        for row, text in enumerate(torch.randint(args.length // 4, args.length - image_tokens, (args.batch,),
                                                 generator=g).tolist()):
            ids[row, :image_tokens] = IMAGE_TOKEN
            ids[row, image_tokens:image_tokens + text] = torch.randint(4, args.vocab, (text,), generator=g)
            ids[row, image_tokens + text - 1] = EOS
            answer = max(1, text // 4)
            targets[row, image_tokens + text - answer:image_tokens + text] = \
                ids[row, image_tokens + text - answer:image_tokens + text]
        pixels = torch.randn(args.batch, 3, 64, 64, generator=g)
        out.append({"input_ids": ids, "attention_mask": ids.ne(PAD).long(), "targets": targets,
                    "images": {"pixel_values": pixels, "rows": {"pixel_values": (1,) * args.batch}}})
    return out


class PlainStep:
    """A hand-written loop on the transformers model: its own loss on the labels, backward, step."""

    def __init__(self, model: torch.nn.Module, data: list[dict[str, Any]]):
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model, self.optimizer = model.to(device).train(), optimizer_of(model)
        self.data = [{"input_ids": b["input_ids"].to(device), "attention_mask": b["attention_mask"].to(device),
                      "labels": b["targets"].to(device), "pixel_values": b["images"]["pixel_values"].to(device)}
                     for b in data]

    def run(self, n: int) -> None:
        for batch in self.data[:n]:
            self.model(**batch).loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()


def plain_model(mine: torch.nn.Module, lora: bool, args: argparse.Namespace) -> torch.nn.Module:
    """The transformers model inside ``mine`` (before any adapters), with peft's adapters where ``lora``."""
    model = copy.deepcopy(mine.model)
    if lora:
        import peft

        language = model.get_submodule("model.language_model")
        peft.inject_adapter_in_model(peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                                     target_modules="all-linear", bias="none"), language)
        for name, p in model.named_parameters():
            p.requires_grad_(".lora_" in name or name.startswith("model.multi_modal_projector."))
    return model


def compare(args: argparse.Namespace, folder: str, lora: bool) -> float:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = batches(args, args.steps)
    plain = plain_model(hf_vlm(folder, args, lora=False), lora, args)
    steps = {"mmvl": MmvlStep(hf_vlm(folder, args, lora).to(device), data), "plain": PlainStep(plain, data)}
    return interleaved(steps, data, args, "lora" if lora else "full", "hf_vlm ")


def main() -> None:
    parser = arguments(__doc__, batch=8, length=128, image_tokens=64)
    parser.add_argument("--vision-width", type=int, default=64)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        llava_folder(args, folder)
        both(lambda lora: compare(args, folder, lora))


if __name__ == "__main__":
    main()
