"""A run as a transformers folder (``mmvl_export hf``): what ``AutoModelForImageTextToText`` and
``AutoProcessor`` load, and so what vLLM serves and lmms-eval scores.

An ``hf_vlm`` run keeps its source folder's architecture: the folder's model gets the run's weights
(LoRA adapters merged into them, through peft, from the same adapter folder ``mmvl_export adapters``
writes); the processor (tokenizer, image processor, chat template) is the one its data was made with;
``generation_config.json`` holds the run's decoding settings with the chat template's end-of-turn as
the end token. With ``adapters``, a LoRA run's folder keeps the source weights and its adapters
beside them, unmerged (``PeftModel.from_pretrained(model, OUT/adapters)``). A run of mmvl's own
``vlm`` whose parts are LLaVA's becomes a ``LlavaForConditionalGeneration`` folder
(:mod:`mmvl.export.llava`). The folder appears whole or not at all.
"""
from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mmvl.checkpoint import load_checkpoint, schema
from mmvl.config.files import read_yaml
from mmvl.errors import UserError
from mmvl.export.adapters import export_run_adapters
from mmvl.export.llava import vlm_as_llava
from mmvl.io import make_temp_dir, publish_dir, remove_tree

#: the models a run of which exports as a transformers folder (vlm: as LLaVA, when its parts are LLaVA's)
EXPORTABLE = ("hf_vlm", "vlm")
#: safetensors shards past this size
SHARD = "5GB"


def run_config(save: Path) -> tuple[str, Mapping[str, Any], Mapping[str, Any]]:
    """``(model, model_config.<model>, the whole config)`` of the run in ``save``, refused in one line
    when it is not an exportable run."""
    if not (save / "config.yaml").is_file():
        raise UserError(f"mmvl_export: {str(save)!r} has no config.yaml; give the env.save_dir of an mmvl run.")
    config = read_yaml(save / "config.yaml", "The run's config")
    model = config.get("model")
    if model not in EXPORTABLE:
        raise UserError(f"mmvl_export hf: a run of model {model!r} cannot be written as a transformers folder; "
                        f"{', '.join(EXPORTABLE)} can (mmvl_export adapters writes a LoRA run's adapters).")
    return model, (config.get("model_config") or {}).get(model) or {}, config


def processor_folder(config: Mapping[str, Any], model_cfg: Mapping[str, Any]) -> str:
    """The folder of the processor the run's data was made with (its first dataset's hf_processor)."""
    for section in (config.get("dataset_config") or {}).values():
        spec = ((section or {}).get("processors") or {}).get("text_processor") or {}
        if spec.get("type") == "hf_processor" and (spec.get("params") or {}).get("path"):
            return str(spec["params"]["path"])
    return str(model_cfg.get("path"))


def export_run_hf(save_dir: str | Path, out: str | Path, checkpoint: str | Path | None = None,
                  best: bool = False, adapters: bool = False) -> str:
    """The run in ``save_dir`` (its last checkpoint; ``best``: its best; ``checkpoint``: that file)
    written to ``out`` as a transformers folder; returns ``out``. ``adapters`` (a LoRA run): ``out`` holds
    the source model as released and ``out/adapters`` the run's peft folder, unmerged."""
    save, out = Path(save_dir), Path(out)
    model, model_cfg, config = run_config(save)
    if out.exists():
        raise UserError(f"mmvl_export hf: {str(out)!r} exists; give a new folder.")
    path = Path(checkpoint) if checkpoint else save / schema.CHECKPOINTS_DIR / (schema.BEST if best else schema.LAST)
    if not path.is_file():
        raise UserError(f"mmvl_export: {str(path)!r} is not a checkpoint file; train the run until it saves one, or "
                        "give --checkpoint PATH.ckpt.")
    from mmvl.models.modules.vlm_parts import quiet_loading

    lora = bool((model_cfg.get("lora") or {}).get("r"))
    if adapters and model == "vlm":
        raise UserError("mmvl_export hf --adapters: a vlm run exports as LLaVA with its adapters merged; export it "
                        "without --adapters (its adapters alone: mmvl_export adapters).")
    if adapters and not lora:
        raise UserError(f"mmvl_export hf --adapters: the run trained no LoRA adapters (model_config.{model}.lora.r is "
                        "null); export it without --adapters.")
    if model == "vlm":  # mmvl's own VLM, as LLaVA
        hf, hf_processor, text = vlm_as_llava(config, model_cfg, path)
        info = text.model_info()
        ids = {"eos_token_id": text.end_id, "pad_token_id": info["pad_token_id"],
               "suppress_tokens": [info["image_token_id"]]}  # vlm.generate never writes a placeholder
    else:
        from mmvl.data.processors.vlm_processor import VLMProcessor

        processor = VLMProcessor(processor_folder(config, model_cfg))  # what the run's samples were made with
        hf_processor = processor.processor
        ids = {"eos_token_id": processor.end_id, "pad_token_id": processor.pad_token_id}
        with quiet_loading():
            source = str(model_cfg.get("path"))
            hf = _source(model, source) if adapters else _weights(model, model_cfg, save, path, source)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(out.parent)
    try:
        hf.generation_config = _generation(hf, ids, model_cfg)
        with quiet_loading():  # no progress bar: the CLI prints one line
            hf.save_pretrained(str(tmp), max_shard_size=SHARD)
        hf_processor.save_pretrained(str(tmp))
        if adapters:
            export_run_adapters(save, tmp / "adapters", checkpoint=path)
    except BaseException:
        remove_tree(tmp)
        raise
    publish_dir(tmp, out)
    return str(out)


def _source(model: str, source: str) -> Any:
    """The run's source model as released (``model_config.<model>.path``)."""
    from transformers import AutoModelForImageTextToText

    from mmvl.data.processors.vlm_processor import check_vlm_folder

    check_vlm_folder(source, f"mmvl_export hf: model_config.{model}.path")
    return AutoModelForImageTextToText.from_pretrained(source, dtype=torch.float32, local_files_only=True)


def _weights(model: str, model_cfg: Mapping[str, Any], save: Path, path: Path, source: str) -> Any:
    """The source folder's model with the run's weights in (LoRA merged)."""
    hf = _source(model, source)
    if (model_cfg.get("lora") or {}).get("r"):
        from peft import PeftModel

        with tempfile.TemporaryDirectory() as folder:
            adapters = Path(folder) / "adapters"
            export_run_adapters(save, adapters, checkpoint=path)
            return PeftModel.from_pretrained(hf, str(adapters)).merge_and_unload()
    state = load_checkpoint(path)[schema.MODEL]
    inner = {key[len("model."):]: value for key, value in state.items() if key.startswith("model.")}
    missing, unexpected = hf.load_state_dict(inner, strict=False)
    if missing or unexpected:
        raise UserError(f"mmvl_export hf: {str(path)!r} does not fit the model in {source!r} ({len(missing)} weights "
                        f"missing, {len(unexpected)} unknown, e.g. {(missing or unexpected)[0]!r}); is it this run's?")
    return hf


def _generation(hf: Any, ids: Mapping[str, Any], model_cfg: Mapping[str, Any]) -> Any:
    """The run's decoding (greedy or beams, its max_new_tokens) ending at the chat template's end of
    turn, with the pad id the run's batches used (``ids``: those and any tokens it never writes)."""
    generation = dict(model_cfg.get("generation") or {})
    config = hf.generation_config
    for key, value in ids.items():
        setattr(config, key, value)
    config.do_sample = False
    config.num_beams = int(generation.get("num_beams") or 1)
    config.max_new_tokens = int(generation.get("max_new_tokens") or 32)
    return config
