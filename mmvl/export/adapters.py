"""A run's LoRA adapters as peft adapter folders (``mmvl_export adapters``).

peft's ``PeftModel.from_pretrained(base, folder)`` reads ``adapter_config.json`` and
``adapter_model.safetensors`` with the adapted module's own parameter names; the run saved them
under the model's part (``lm.q_proj.lora_A.default.weight``), so export strips the part's prefix
and the adapter's name. A model that holds a whole transformers model (``ADAPTER_ROOT``: a released
VLM) gets one folder for it, the base users load with ``AutoModelForImageTextToText``. The
checkpoint's location comes from the checkpoint schema.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mmvl.adapters import is_adapter, lora_spec
from mmvl.checkpoint import load_checkpoint, schema
from mmvl.errors import UserError
from mmvl.config.files import read_yaml
from mmvl.io import make_temp_dir, publish_dir, remove_tree
from mmvl.registry import MODELS


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
                    state: Mapping[str, Any], out: Any, base_path: str | None = None, root: str | None = None,
                    trained: list[str] = ()) -> list[str]:
    """Write each adapted part's adapters as a peft adapter folder (``adapter_config.json``,
    ``adapter_model.safetensors``): ``out`` for one part, ``out/<part>`` for several; with ``root``
    (the model's attribute holding a whole transformers model, e.g. a released VLM), one folder of
    every adapter for that model, whose ``target_modules`` name the adapted layers exactly, with the
    ``trained`` modules' own weights (peft's ``modules_to_save``). Atomic:
    the folder appears whole or not at all. Returns the folders written."""
    lora = lora_spec(spec, model)
    if lora is None:
        raise UserError(f"mmvl_export adapters: the run trained no LoRA adapters (model_config.{model}.lora.r is null); "
                        "export a run with lora set.")
    out = Path(out)
    if out.exists():
        raise UserError(f"mmvl_export adapters: {str(out)!r} exists; give a new folder.")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(out.parent)
    try:
        written = _write_root(lora, root, state, tmp, out, base_path, trained) if root else \
            _write_parts(lora, parts, state, tmp, out, base_path)
    except BaseException:
        remove_tree(tmp)  # a refusal (or a crash) leaves nothing beside OUT
        raise
    publish_dir(tmp, out)
    return written


def _write_parts(lora: Mapping[str, Any], parts: Mapping[str, tuple[str, ...]], state: Mapping[str, Any], tmp: Path,
                 out: Path, base_path: str | None) -> list[str]:
    """Each adapted part's peft folder under ``tmp`` (``tmp`` itself for one part); the folders' final names."""
    import peft
    from safetensors.torch import save_file

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
    return written


def _write_root(lora: Mapping[str, Any], root: str, state: Mapping[str, Any], tmp: Path, out: Path,
                base_path: str | None, trained: list[str]) -> list[str]:
    """One peft folder for the transformers model at ``root``: its adapters, and the layers they adapt
    by full name (the parts' adapters only: a target suffix would also match layers of other parts)."""
    import re

    import peft
    from safetensors.torch import save_file

    tensors = adapter_tensors(state, root)
    if not tensors:
        raise UserError("mmvl_export adapters: the checkpoint holds no adapters; is it this run's?")
    layers = sorted({key[len("base_model.model."):].split(".lora_", 1)[0] for key in tensors})
    for key, value in state.items():  # the trained modules' own weights, as peft saves modules_to_save
        inner = key[len(root) + 1:] if key.startswith(root + ".") else None
        if inner and not is_adapter(key) and any(inner.startswith(m + ".") for m in trained):
            tensors[f"base_model.model.{inner}"] = value.detach().cpu().contiguous()
    config = peft.LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"], bias="none",
                             target_modules="^(" + "|".join(re.escape(n) for n in layers) + ")$",
                             modules_to_save=list(trained) or None, base_model_name_or_path=base_path)
    config.save_pretrained(str(tmp))
    save_file(tensors, str(tmp / "adapter_model.safetensors"))
    return [str(out)]


def export_run_adapters(save_dir: str | Path, out: str | Path, checkpoint: str | Path | None = None) -> list[str]:
    """The adapters of the run in ``save_dir`` (its ``config.yaml`` and, unless ``checkpoint`` names
    another file, its last checkpoint) written under ``out``; returns the folders written."""
    save = Path(save_dir)
    if not (save / "config.yaml").is_file():
        raise UserError(f"mmvl_export: {str(save)!r} has no config.yaml; give the env.save_dir of an mmvl run.")
    config = read_yaml(save / "config.yaml", "The run's config")  # a torn or foreign file: one line
    model = config.get("model")
    if not isinstance(model, str) or not model:
        raise UserError(f"mmvl_export: {str(save / 'config.yaml')!r} names no model (model: {model!r}); give the "
                        "env.save_dir of an mmvl run (its config.yaml is written when the run starts).")
    path = Path(checkpoint) if checkpoint else save / schema.CHECKPOINTS_DIR / schema.LAST
    if not path.is_file():
        raise UserError(f"mmvl_export: {str(path)!r} is not a checkpoint file; train the run until it saves one, or "
                        "give --checkpoint PATH.ckpt.")
    state = load_checkpoint(path)[schema.MODEL]
    model_cfg = (config.get("model_config") or {}).get(model) or {}
    if not isinstance(model_cfg, Mapping):
        raise UserError(f"mmvl_export: model_config.{model} in {str(save / 'config.yaml')!r} is not a mapping.")
    cls = MODELS.get(model)
    root = getattr(cls, "ADAPTER_ROOT", None)
    base = model_cfg.get("path") if root else (model_cfg.get("language_model") or {}).get("path")
    trained = cls.trained_modules(model_cfg, list(state)) if root else []
    return export_adapters(model, cls.PARTS, model_cfg.get("lora"), state, out, base_path=str(base) if base else None,
                           root=root, trained=trained)
