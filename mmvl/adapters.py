"""LoRA adapters through peft (``model_config.<model>.lora``; ``pip install 'mmvl[peft]'``): the spec's
checks, the injection, and which parameter names are adapters.

peft's ``inject_adapter_in_model`` puts the adapters into each adapted part's module in place, no
wrapper: a part's parameter names stay the standalone module's (``q_proj.base_layer.weight``,
``q_proj.lora_A.default.weight``), so what the run saves maps one to one onto what peft saves for
that module. The adapted parts' own weights stop training; their adapters, and whatever ``freeze``
leaves trainable elsewhere (the VLM's projector), train. ``r: null`` is off, and then peft is never
imported.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mmvl.config.access import plain
from mmvl.errors import UserError, library_input

#: what the adapters' parameter names hold (peft's naming)
ADAPTER_MARK = ".lora_"
KEYS = ("r", "alpha", "dropout", "target_modules", "parts")


def lora_spec(spec: Mapping[str, Any] | None, model: str) -> dict[str, Any] | None:
    """``model_config.<model>.lora`` checked; None when it is off (``r`` null)."""
    spec = dict(plain(spec) or {})  # plain lists: a ListConfig is not a list
    where = f"model_config.{model}.lora"
    unknown = sorted(set(spec) - set(KEYS))
    if unknown:
        raise UserError(f"{where}: unknown keys {unknown}; it takes {', '.join(KEYS)}.")
    if spec.get("r") is None:
        return None
    r = spec["r"]
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise UserError(f"{where}.r={r!r} must be an integer of 1 or more (e.g. 8), or null for no LoRA.")
    alpha, dropout = spec.get("alpha"), spec.get("dropout") or 0.0
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise UserError(f"{where}.alpha={alpha!r} must be a number above 0 (e.g. twice r).")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= float(dropout) < 1:
        raise UserError(f"{where}.dropout={dropout!r} must be a number in [0, 1).")
    parts = spec.get("parts")
    if not parts or not isinstance(parts, (list, tuple)) or not all(isinstance(p, str) and p for p in parts):
        raise UserError(f"{where}.parts={parts!r}: give a list of the model's parts to adapt, e.g. [language_model].")
    return {"r": r, "alpha": float(alpha), "dropout": float(dropout), "parts": list(parts),
            "target_modules": _targets(spec.get("target_modules", ["all-linear"]), where)}


def _targets(given: Any, where: str) -> str | list[str]:
    """``target_modules``: a name or a list of names (null: every linear layer); an empty list, which
    would adapt nothing, or a non-name is refused rather than read as all-linear."""
    targets = [given] if isinstance(given, str) else ["all-linear"] if given is None else given
    if not isinstance(targets, (list, tuple)) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise UserError(f"{where}.target_modules={given!r}: name the linear layers to adapt (e.g. [q_proj, v_proj]) "
                        "or give [all-linear].")
    return "all-linear" if list(targets) == ["all-linear"] else list(targets)


def apply_lora(model: Any, spec: Mapping[str, Any] | None, name: str) -> list[str]:
    """Inject adapters into ``spec["parts"]`` of ``model`` (a BaseModel: its ``PARTS``) and freeze those
    parts' own weights; returns the adapted parts ([] when LoRA is off)."""
    lora = lora_spec(spec, name)
    if lora is None:
        return []
    try:
        import peft
    except ImportError:
        raise UserError(f"model_config.{name}.lora needs peft: pip install 'mmvl[peft]'.") from None
    where = f"model_config.{name}.lora"
    parts = getattr(model, "PARTS", {})
    for part in lora["parts"]:
        if part not in parts:
            raise UserError(f"{where}.parts: {name} has no part {part!r}; its parts are {', '.join(parts) or 'none'}.")
        adapters = 0
        for attr in parts[part]:
            module = model.get_submodule(attr)
            # another part inside this one (Qwen2-VL's merger, the connector, inside its vision tower) is not adapted
            inner = [other[len(attr) + 1:] for mods in parts.values() for other in mods if other.startswith(attr + ".")]
            trains = {n: p.requires_grad for n, p in module.named_parameters()}
            if not isinstance(module, torch.nn.Linear):  # a bare output head of a part: frozen, never adapted
                targets = explicit_targets(module, lora["target_modules"], inner) if inner else lora["target_modules"]
                config = peft.LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                                         target_modules=targets, bias="none")
                with library_input(f"{where}: target_modules={lora['target_modules']!r} on part {part!r}",
                                   "name linear layers of that part (e.g. [q_proj, v_proj]) or all-linear."):
                    peft.inject_adapter_in_model(config, module)
            for pname, p in module.named_parameters():
                if any(pname.startswith(prefix + ".") for prefix in inner):
                    p.requires_grad_(trains[pname])  # the inner part's weights are its own to freeze or train
                    continue
                adapted = is_adapter(pname)
                p.requires_grad_(adapted)
                adapters += p.numel() if adapted else 0
        if not adapters:
            raise UserError(f"{where}: part {part!r} got no adapters from target_modules="
                            f"{lora['target_modules']!r}; name its linear layers.")
    return lora["parts"]


def explicit_targets(module: Any, targets: str | list[str], skip: list[str]) -> str:
    """The linear layers of ``module`` that ``targets`` names (``all-linear``, or name suffixes), outside
    the sub-modules ``skip``, as a regular expression of their full names (what peft matches exactly)."""
    import re

    names = [name for name, sub in module.named_modules()
             if isinstance(sub, torch.nn.Linear) and not any(name == s or name.startswith(s + ".") for s in skip)
             and (targets == "all-linear" or any(name == t or name.endswith("." + t) for t in targets))]
    return "^(" + "|".join(re.escape(n) for n in names) + ")$" if names else "^$"


def is_adapter(key: str) -> bool:
    """Whether a parameter name is a LoRA adapter's (peft's ``lora_A``/``lora_B``)."""
    return ADAPTER_MARK in f".{key}"


def merge_lora(model: torch.nn.Module) -> torch.nn.Module:
    """Fold each LoRA adapter of ``model`` into the weight it adapts and put the plain layer back in
    its place (what an export writes: the model as if it had trained whole, without peft)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            module.merge()
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, module.get_base_layer())
    return model
