"""LoRA adapters through peft (``model_config.<model>.lora``; ``pip install 'mmvl[peft]'``).

peft's ``inject_adapter_in_model`` puts the adapters into each adapted part's module in place, no
wrapper: a part's parameter names stay the standalone module's (``q_proj.base_layer.weight``,
``q_proj.lora_A.default.weight``), so what the run saves maps one to one onto what peft saves for
that module. The adapted parts' own weights stop training; their adapters, and whatever ``freeze``
leaves trainable elsewhere (the VLM's projector), train. ``r: null`` is off, and then peft is never
imported.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from mmvl.errors import UserError, library_input
from mmvl.io import make_temp_dir, publish_dir

#: what the adapters' parameter names hold (peft's naming)
ADAPTER_MARK = ".lora_"
KEYS = ("r", "alpha", "dropout", "target_modules", "parts")


def lora_spec(spec: Mapping[str, Any] | None, model: str) -> dict[str, Any] | None:
    """``model_config.<model>.lora`` checked; None when it is off (``r`` null)."""
    spec = dict(spec or {})
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
    if not 0 <= float(dropout) < 1:
        raise UserError(f"{where}.dropout={dropout!r} must be in [0, 1).")
    parts = spec.get("parts")
    if not parts or isinstance(parts, str):
        raise UserError(f"{where}.parts={parts!r}: give a list of the model's parts to adapt, e.g. [language_model].")
    targets = [str(t) for t in ([spec["target_modules"]] if isinstance(spec.get("target_modules"), str)
                                else spec.get("target_modules") or ["all-linear"])]
    return {"r": r, "alpha": float(alpha), "dropout": float(dropout), "parts": [str(p) for p in parts],
            "target_modules": "all-linear" if targets == ["all-linear"] else targets}


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
        for attr in parts[part]:
            module = model.get_submodule(attr)
            config = peft.LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                                     target_modules=lora["target_modules"], bias="none")
            with library_input(f"{where}: target_modules={lora['target_modules']!r} on part {part!r}",
                               "name linear layers of that part (e.g. [q_proj, v_proj]) or all-linear."):
                peft.inject_adapter_in_model(config, module)
            adapters = 0
            for pname, p in module.named_parameters():
                adapted = is_adapter(pname)
                p.requires_grad_(adapted)
                adapters += p.numel() if adapted else 0
            if not adapters:
                raise UserError(f"{where}: part {part!r} got no adapters from target_modules="
                                f"{lora['target_modules']!r}; name its linear layers.")
    return lora["parts"]



def is_adapter(key: str) -> bool:
    """Whether a parameter name is a LoRA adapter's (peft's ``lora_A``/``lora_B``)."""
    return ADAPTER_MARK in f".{key}"


def onto_adapted(weights: Mapping[str, Any], model_keys: Iterable[str]) -> dict[str, Any]:
    """Weights saved without LoRA (a stage-1 checkpoint) renamed onto a model with adapters: peft
    keeps an adapted layer's own weights as ``X.base_layer.weight`` where the checkpoint has
    ``X.weight``. Keys the model has as they are, and keys of no adapted layer, stay; the adapters
    themselves are not in such a checkpoint and keep their initialisation (B at zero: the adapted
    model computes what the checkpoint's model did)."""
    keys = set(model_keys)
    out = {}
    for key, value in weights.items():
        head, _, leaf = key.rpartition(".")
        moved = f"{head}.base_layer.{leaf}"
        out[moved if key not in keys and moved in keys else key] = value
    return out


def adapter_tensors(state: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """The adapters under ``prefix`` (a part's module, e.g. ``lm``) of a model state dict, by the
    names ``PeftModel.from_pretrained`` reads: ``base_model.model.<name in the module>`` without the
    adapter's name (``q_proj.lora_A.default.weight`` -> ``q_proj.lora_A.weight``)."""
    out = {}
    for key, value in state.items():
        if key.startswith(prefix + ".") and is_adapter(key):
            inner = key[len(prefix) + 1:].replace(".default.", ".")
            out[f"base_model.model.{inner}"] = value.detach().cpu().contiguous()
    return out


def export_adapters(model: str, parts: Mapping[str, tuple[str, ...]], spec: Mapping[str, Any] | None,
                    state: Mapping[str, Any], out: Any, base_path: str | None = None) -> list[str]:
    """Write each adapted part's adapters as a peft adapter folder (``adapter_config.json``,
    ``adapter_model.safetensors``): ``out`` for one part, ``out/<part>`` for several. Atomic: the
    folder appears whole or not at all. Returns the folders written."""
    lora = lora_spec(spec, model)
    if lora is None:
        raise UserError(f"mmvl_export adapters: the run trained no LoRA adapters (model_config.{model}.lora.r is null); "
                        "export a run with lora set.")
    import peft
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists():
        raise UserError(f"mmvl_export adapters: {str(out)!r} exists; give a new folder.")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(out.parent)
    written = []
    for part in lora["parts"]:
        folder = tmp if len(lora["parts"]) == 1 else tmp / part
        folder.mkdir(exist_ok=True)
        tensors = {k: v for module in parts.get(part, ()) for k, v in adapter_tensors(state, module).items()}
        if not tensors:
            raise UserError(f"mmvl_export adapters: the checkpoint holds no adapters of part {part!r}; is it this run's?")
        config = peft.LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                                 target_modules=lora["target_modules"], bias="none",
                                 task_type="CAUSAL_LM" if part == "language_model" else None,
                                 base_model_name_or_path=base_path if part == "language_model" else None)
        config.save_pretrained(str(folder))
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        written.append(str(out if len(lora["parts"]) == 1 else out / part))
    publish_dir(tmp, out)
    return written
