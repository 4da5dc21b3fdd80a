"""``hf_vlm``: a released VLM (LLaVA, Idefics3/SmolVLM, Qwen2-VL, PaliGemma, ...) from a local folder.

transformers loads it through ``AutoModelForImageTextToText``; its samples come from the folder's
own processor (the ``hf_processor`` text processor of the conversation datasets), which fills this
section's null ``eos_token_id``, ``pad_token_id`` and ``processor``. ``forward`` hands the model
the tokens, their mask, every per-token key its processor returns that the model's forward takes
(``token_type_ids``, ``mm_token_type_ids``) and the batch's image tensors, and returns the logits as
``scores`` for the ``answer_tokens`` loss. :meth:`generate` continues each prompt with the model's
own ``generate`` and returns only the new tokens.

Parts (``freeze``) have the same names on every architecture: ``vision``, ``connector`` and
``language_model``, found in the loaded model by the names transformers 5 gives them (a connector
inside the vision tower, as Qwen2-VL's merger, is not part of ``vision``).
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from omegaconf import DictConfig

from mmvl.data.processors.vlm_processor import IMAGES, ROWS, UNPLACED, check_vlm_folder
from mmvl.errors import UserError, library_input
from mmvl.models.base import BaseModel, under_prefix
from mmvl.models.modules.vlm_parts import (checkpoint_transformers, fixed_width, left_align, lm_packed_inputs,
                                           prompt_mask, quiet_loading)
from mmvl.models.vlm import check_generation
from mmvl.registry import register_model

#: common part name -> the module names transformers 5 uses for it, in the order they are looked for
PART_NAMES = {
    "vision": ("model.vision_tower", "model.visual", "model.vision_model"),
    "connector": ("model.multi_modal_projector", "model.connector", "model.visual.merger"),
    "language_model": ("model.language_model", "model.text_model"),
}


def load_vlm(path: Any, attn_implementation: str) -> torch.nn.Module:
    """The folder's model as ``AutoModelForImageTextToText`` loads it, in float32 (autocast makes the
    half-precision compute); a folder of a text-only LM is refused, pointing to ``model: vlm``."""
    where = "model_config.hf_vlm.path"
    check_vlm_folder(path, where)
    from transformers import AutoModelForImageTextToText

    with library_input(f"{where}={str(path)!r} does not load", "give a folder written by save_pretrained."), \
            quiet_loading():
        return AutoModelForImageTextToText.from_pretrained(str(path), attn_implementation=attn_implementation,
                                                           dtype=torch.float32, local_files_only=True)


def find_parts(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """``vision``/``connector``/``language_model`` -> module names in ``model`` (prefixed ``model.``,
    the attribute :class:`HFVLM` keeps it under; the language model's output head with it); a part
    not found is refused, listing what there is."""
    return parts_in({name for name, _ in model.named_modules()}, type(model).__name__)


def parts_in(names: set[str], kind: str) -> dict[str, tuple[str, ...]]:
    """:func:`find_parts` on the module names of a model of class ``kind``."""
    found = {}
    for part, candidates in PART_NAMES.items():
        hit = next((c for c in candidates if c in names), None)
        if hit is None:
            top = sorted({n.split(".")[0] for n in names if n} | {n for n in names if n.count(".") == 1})
            raise UserError(f"hf_vlm: {kind} has no {part} module under the names mmvl knows "
                            f"({', '.join(candidates)}); its modules are {', '.join(top)}.")
        found[part] = (f"model.{hit}",)
    if "lm_head" in names:  # the LM's output head is the language model's: LLaVA's stage 1 freezes it too
        found["language_model"] += ("model.lm_head",)
    return found


def tensors_of(output: Any) -> list[torch.Tensor]:
    """The tensors in a model output (a tensor, a tuple or list of them, or a ModelOutput)."""
    if isinstance(output, torch.Tensor):
        return [output]
    values = output.values() if hasattr(output, "values") else output if isinstance(output, (list, tuple)) else []
    return [t for v in values for t in tensors_of(v)]


#: the architectures whose packed rows are checked equal to padded batches (tests/data/test_packing.py)
PACKABLE = ("llava", "idefics3")
#: what keeps others from packing
PACKING_BLOCKERS = {"qwen2_vl": "its multimodal rotary positions are not restarted per sample",
                    "qwen2_5_vl": "its multimodal rotary positions are not restarted per sample",
                    "paligemma": "its prefix attends both ways, which a causal block mask does not",
                    "gemma3": "its image tokens attend both ways, which a causal block mask does not"}
#: forward arguments mmvl sets itself (or never): the tokens, their mask, labels (mmvl's loss reads ``targets``), caches
_NOT_FROM_BATCH = ("input_ids", "attention_mask", "labels", "inputs_embeds", "past_key_values", "use_cache",
                   "cache_position", "logits_to_keep", "pixel_values")


@register_model("hf_vlm")
class HFVLM(BaseModel):
    """``forward(batch) -> {"scores": B x L x vocab logits}``; ``generate(batch) -> B x new ids``."""

    config_path = "models/hf_vlm.yaml"
    #: the output head (``base`` is everything else); tied to the input embeddings it holds no parameters of its own
    HEAD = ("model.lm_head",)
    #: LLaVA-style models read an inner layer of their vision tower (the layers after it, its final norm,
    #: get no gradient), and a batch without images leaves the whole tower out
    leaves_parameters_unused = True
    #: ``mmvl_export adapters`` writes one peft folder for the whole VLM (what AutoModelForImageTextToText loads)
    ADAPTER_ROOT = "model"
    packs_samples = True  # forward takes packed rows: of the architectures packing_blocker lets through

    def __init__(self, config: DictConfig):
        super().__init__(config)
        if config.get("processor") is None:
            raise UserError("model hf_vlm reads samples made by its folder's processor, and no dataset gave one; set "
                            "dataset_config.<dataset>.processors.text_processor.type=hf_processor with params.path "
                            "the model folder (projects/hf_vlm/configs/defaults.yaml does).")
        self.generation = check_generation(config.generation)
        self.model = load_vlm(config.path, str(config.attn_implementation))
        self.PARTS = find_parts(self.model)
        self.eos_token_id, self.pad_token_id = int(config.eos_token_id), int(config.pad_token_id)
        taken = inspect.signature(self.model.forward).parameters
        #: the batch keys the model's forward takes besides the tokens, their mask and the image tensors: the
        #: processor's per-token keys (token_type_ids, mm_token_type_ids, ...); mmvl's own labels never go in
        self.token_keys = tuple(k for k, p in taken.items() if p.kind is p.POSITIONAL_OR_KEYWORD
                                and k not in _NOT_FROM_BATCH)

    @classmethod
    def trained_modules(cls, config: Any, keys: list[str]) -> list[str]:
        """The modules (names under :attr:`ADAPTER_ROOT`) whose own weights a run of ``config`` (its
        ``model_config.hf_vlm``) trained besides its LoRA adapters, from its checkpoint's ``keys``: the
        parts neither frozen nor adapted (and the output head under ``freeze: [base]``). What an
        adapter folder must carry (peft's ``modules_to_save``) to generate as the run does."""
        names = {".".join(key.split(".")[1:i]) for key in keys if key.startswith("model.")
                 for i in range(2, key.count(".") + 1)}
        parts = {part: tuple(m[len("model."):] for m in mods) for part, mods in parts_in(names, "the run").items()}
        frozen = set(config.get("freeze") or [])
        adapted = set(((config.get("lora") or {}).get("parts") or [])) if (config.get("lora") or {}).get("r") else set()
        out = [m for part, mods in parts.items() if part not in frozen | adapted and "base" not in frozen
               for m in mods]
        if "base" in frozen and "language_model" not in frozen | adapted and "lm_head" in names:
            out.append("lm_head")
        return [m for m in out if not any(m.startswith(o + ".") for o in out)]  # an inner module goes with its outer

    def part_parameters(self) -> dict[str, list[str]]:
        """The base's parts, with a connector that sits inside the vision tower left out of ``vision``."""
        out = super().part_parameters()
        if "vision" in out and "connector" in out:
            out["vision"] = [n for n in out["vision"] if not under_prefix(n, self.PARTS["connector"])]
        return out

    def inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The model's keyword arguments from a batch (image tensors only where the batch has images)."""
        kwargs = {"input_ids": batch["input_ids"], "attention_mask": batch.get("attention_mask")}
        kwargs.update({k: batch[k] for k in self.token_keys if isinstance(batch.get(k), torch.Tensor)})
        images = batch.get(IMAGES)
        if isinstance(images, dict) and not images.get(UNPLACED):
            kwargs.update({k: v for k, v in images.items() if k != ROWS})
        return kwargs

    def packing_blocker(self) -> str | None:
        """Why this architecture cannot train on packed rows (None: it can): its image features must
        go to the placeholders row by row and its text positions be plain per-token ones."""
        kind = str(self.model.config.model_type)
        if kind in PACKABLE:
            return None
        return (f"hf_vlm's {kind} cannot train on packed rows yet ({PACKING_BLOCKERS.get(kind, 'not checked')}); "
                f"packing runs on {', '.join(PACKABLE)}")

    def forward(self, batch: dict[str, Any]) -> dict[str, Any]:
        unused = self.unplaced_features(batch)  # first: where the other ranks' forwards encode their images
        kwargs = self.inputs(batch)
        if batch.get("position_ids") is not None:  # packed rows (training.packing): attention within each sample
            kwargs.update(lm_packed_inputs(self.model.config.get_text_config(), batch, torch.float32))
        logits = self.model(**kwargs, use_cache=False).logits
        return {"scores": logits if unused is None else logits + 0.0 * unused}

    def unplaced_features(self, batch: dict[str, Any]) -> torch.Tensor | None:
        """Under sharding, for a batch without images: the vision tower run on the blank image it
        carries, placed nowhere (a scalar to add times zero), so that its gathers meet the other ranks'
        as their image encoding comes first in their forward; None otherwise."""
        images = batch.get(IMAGES)
        if not (self.every_part_each_forward and isinstance(images, dict) and images.get(UNPLACED)):
            return None
        unplaced = {k: v for k, v in images.items() if k not in (ROWS, UNPLACED)}
        return sum(t.float().sum() for t in tensors_of(self.model.get_image_features(**unplaced)))

    @torch.no_grad()
    def generate(self, batch: dict[str, Any], **overrides: Any) -> torch.Tensor:
        """Continue each prompt (right-padded, as collated; a labelled batch is cut before its first
        answer token) greedily or by beams; returns ``B x max_new_tokens`` new ids (pad after the end)."""
        synced = bool(overrides.pop("synced_gpus", False))  # sharded parameters: every rank steps until all end
        opts = {**self.generation, **overrides}
        mask = prompt_mask(batch)
        kwargs = self.inputs(batch)
        kwargs["input_ids"], kwargs["attention_mask"] = left_align(batch["input_ids"], mask, self.pad_token_id)
        for key in self.token_keys:  # per-token keys make the same moves as the tokens
            if key in kwargs and kwargs[key].shape == batch["input_ids"].shape:
                kwargs[key] = left_align(kwargs[key], mask, 0)[0]
        width = int(opts["max_new_tokens"])
        self.unplaced_features(batch)  # a rank without images encodes a blank one where the others' prefill encodes theirs
        out = self.model.generate(**kwargs, do_sample=False, max_new_tokens=width, num_beams=int(opts["num_beams"]),
                                  pad_token_id=self.pad_token_id, eos_token_id=self.eos_token_id, synced_gpus=synced)
        return fixed_width(out[:, kwargs["input_ids"].size(1):], width, self.pad_token_id)

    def enable_gradient_checkpointing(self) -> None:
        checkpoint_transformers(self.model)

    def shard_units(self) -> list[torch.nn.Module]:
        """The model's repeated blocks, what FSDP shards one by one and checkpoints: each entry of a
        layer list that is, or holds, a module transformers keeps whole (``_no_split_modules``: the
        decoder layers, the vision encoder's layers or blocks)."""
        kinds = set(getattr(self.model, "_no_split_modules", None) or [])
        units: list[torch.nn.Module] = []
        taken: set[int] = set()
        for module in self.model.modules():
            if not isinstance(module, torch.nn.ModuleList) or id(module) in taken:
                continue
            for block in module:
                if any(c.__name__ in kinds for m in block.modules() for c in type(m).__mro__):  # FSDP subclasses
                    units.append(block)
                    taken.update(id(m) for m in block.modules())
        return units
