"""MMF configs, loaded unchanged: MMF's config keys and what each becomes in mmvl, in one table.

A user layer (a YAML file or the command line) is translated before it is validated. Only keys
mmvl does not have itself are looked up here, so a key both know keeps mmvl's meaning, and a key
mmvl adds later wins over this table without an edit. Per key, in this order:

- ``RENAMED``: MMF's key under mmvl's name (``*`` is one name: a model, dataset or processor),
  its value mapped where MMF's values differ;
- ``ABSORBED``: MMF switches whose listed values are what mmvl always does (dropped quietly);
  any other value is not reproduced and is reported;
- ``UNUSED``: MMF keys mmvl has no use for: removed and listed in ONE warning line per load.

Anything else stays as written, so a key that is neither mmvl's nor MMF's is still an error.
``VALUES`` maps MMF's values of keys both share (``training.trainer: mmf``); MMF's run types
(``train_inference``, ``train_val_inference``) are read by :func:`mmvl.config.schema.parse_run_type`.
MMF's ``includes: [configs/...]`` resolve against mmvl's ``configs/`` (see :func:`include_path`).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("mmvl")

#: MMF key -> (mmvl key, {MMF value: mmvl value} or None to keep the value)
RENAMED: dict[str, tuple[str, dict[Any, Any] | None]] = {
    "training.find_unused_parameters": ("distributed.find_unused_parameters", None),
    "training.exit_on_nan_losses": ("training.exit_on_nan", None),
    "model_config.*.pooler_strategy": ("model_config.*.classifier_input",
                                       {"default": "pooled", "vqa": "last_text_token"}),
    "model_config.*.finetune_lr_multiplier": ("model_config.*.text_encoder.lr_multiplier", None),
    "model_config.*.bert_model_name": ("model_config.*.text_encoder.pretrained_path", None),
    "model_config.*.visual_embedding_dim": ("model_config.*.feature_dim", None),
    # a Hugging Face model name: the bert_tokenizer finds it in the local cache (never downloads)
    "dataset_config.*.processors.*.params.tokenizer_config.type":
        ("dataset_config.*.processors.*.params.tokenizer_path", None),
    "dataset_config.*.processors.*.params.tokenizer_config.params.do_lower_case":
        ("dataset_config.*.processors.*.params.do_lower_case", None),
    "training.wandb.project": ("training.tracker_project", None),
}
#: MMF key -> the values that mean what mmvl always does; other values go to ``_switch``
ABSORBED: dict[str, tuple[Any, ...]] = {
    "training.lr_scheduler": (True,),  # mmvl steps the configured scheduler; false: no scheduler
    "dataset_config.*.return_features_info": (True,),  # the features processor always returns boxes and sizes
    "multitasking.enabled": (True,),  # several datasets are always sampled by multitasking.type
    "training.clip_gradients": (),  # with max_grad_l2_norm: training.clip_grad_norm
    "training.max_grad_l2_norm": (),
    "model_config.*.training_head_type": ("classification",),  # models without a pretraining head
    "training.wandb.enabled": (False,),  # true: wandb joins training.trackers
    # false: nothing frozen (mmvl's default); true: the part joins model_config.*.freeze (FREEZE_PARTS)
    "model_config.*.freeze_base": (False,),
    "model_config.*.freeze_complete_base": (False,),
    "model_config.*.freeze_text": (False,),
    "model_config.*.freeze_modal": (False,),
}
#: MMF's freeze switch -> the part of ``model_config.<model>.freeze`` it names (every model offers
#: ``base``: all but its head; the BERT models and the Relation Network name their text and image
#: sides ``text_encoder`` and ``image_encoder``)
FREEZE_PARTS = {"freeze_base": "base", "freeze_complete_base": "base", "freeze_text": "text_encoder",
                "freeze_modal": "image_encoder"}
#: MMF keys mmvl has no use for (a key names its whole subtree)
UNUSED: tuple[str, ...] = (
    "config", "config_version", "trainer",
    "training.experiment_name", "training.logger_level", "training.log_format", "training.log_detailed_config",
    "training.should_not_log", "training.cudnn_benchmark", "training.wandb",
    "training.batch_size_per_device", "training.fast_read", "training.dataset_size_proportional_sampling",
    "training.clip_norm_mode", "training.lr_steps", "training.lr_ratio",
    "training.use_warmup", "training.warmup_factor", "training.warmup_iterations", "training.local_rank",
    "training.verbose_dump", "training.evaluate_metrics", "training.detect_anomaly",
    "evaluation.use_cpu", "evaluation.predict_file_format", "evaluation.reporter",
    "optimizer.allow_unused_parameters",
    "env.dataset_zoo", "env.model_zoo", "env.log_dir", "env.report_dir",
    "distributed.no_spawn",
    "checkpoint.resume_zoo", "checkpoint.zoo_config_override", "checkpoint.save_git_details", "checkpoint.reset",
    "model_config.*.special_visual_initialize", "model_config.*.embedding_strategy",
    "model_config.*.bypass_transformer", "model_config.*.output_attentions", "model_config.*.output_hidden_states",
    "model_config.*.random_initialize", "model_config.*.zerobias",
    "model_config.*.direct_features_input", "model_config.*.fused_feature_only", "model_config.*.modal_hidden_size",
    "model_config.*.text_hidden_size", "model_config.*.modal_encoder", "model_config.*.use_modal_start_token",
    "model_config.*.use_modal_end_token", "model_config.*.text_encoder.type", "model_config.*.text_encoder.params",
    "dataset_config.*.data_dir", "dataset_config.*.depth_first", "dataset_config.*.fast_read",
    "dataset_config.*.use_images", "dataset_config.*.use_features", "dataset_config.*.zoo_requirements",
    "dataset_config.*.features", "dataset_config.*.annotations", "dataset_config.*.images",
    "dataset_config.*.max_features", "dataset_config.*.use_ocr", "dataset_config.*.use_ocr_info",
    "dataset_config.*.annotation_style", "dataset_config.*.min_captions_per_img",
    "dataset_config.*.processors.bbox_processor", "dataset_config.*.processors.context_processor",
    "dataset_config.*.processors.ocr_token_processor", "dataset_config.*.processors.caption_processor",
)
#: keys both have, MMF value -> mmvl value
VALUES: dict[str, dict[Any, Any]] = {
    "training.trainer": {"mmf": "mmvl"},
}
#: where MMF's ``includes: [configs/...]`` live in its package; mmvl's configs/ folder stands in
INCLUDE_PREFIX = "configs/"

Path_ = tuple[str, ...]


def include_path(include: str, config_root: Path) -> Path | None:
    """MMF resolves ``configs/...`` includes against its package; here: mmvl's equivalent file."""
    if not include.startswith(INCLUDE_PREFIX):
        return None
    candidate = config_root / include[len(INCLUDE_PREFIX):]
    return candidate if candidate.is_file() else None


def translate(layer: dict[str, Any], base: dict[str, Any], source: str,
              unused: list[tuple[str, str]]) -> dict[str, Any]:
    """``layer`` with MMF's keys turned into mmvl's; the MMF keys mmvl does not use are appended
    to ``unused`` as ``(key, source)`` (see :func:`warn_unused`)."""
    out: dict[str, Any] = {}
    for path, value in _leaves(layer):
        value = _mapped_value(path, value)
        if len(path) == 3 and path[0] == "model_config" and path[2] == "freeze" and isinstance(value, list):
            _add_frozen(out, path[1], *value)  # with the parts MMF's switches put there earlier in this layer
            continue
        if _native(path, base):
            _put(out, path, value)
            continue
        rule = _match(path, RENAMED)
        if rule is not None:
            pattern, (target, values) = rule
            if values is None or (_scalar(value) and value in values):
                _put(out, _rename(path, pattern, target), value if values is None else values[value])
                continue
            unused.append((f"{'.'.join(path)}={value}", source))
            continue
        rule = _match(path, ABSORBED)
        if rule is not None:
            if value not in rule[1] and not _switch(path, value, layer, out, base):
                unused.append((f"{'.'.join(path)}={value}", source))
            continue
        rule = _match(path, dict.fromkeys(UNUSED))
        if rule is not None:
            key = ".".join(path[:len(rule[0].split("."))])
            if (key, source) not in unused:
                unused.append((key, source))
            continue
        _put(out, path, value)
    return out


def warn_unused(unused: list[tuple[str, str]]) -> None:
    """One warning line naming every MMF key mmvl ignored, with where it was set (rank 0 only)."""
    if not unused or os.environ.get("RANK", "0") != "0":
        return
    by_source: dict[str, list[str]] = {}
    for key, source in unused:
        by_source.setdefault(source, []).append(key)
    where = "; ".join(f"{', '.join(keys)} ({source})" for source, keys in by_source.items())
    log.warning("MMF keys mmvl does not use, ignored: %s", where)


# -- MMF switches that set another key -----------------------------------------------------------
def _switch(path: Path_, value: Any, layer: dict[str, Any], out: dict[str, Any], base: dict[str, Any]) -> bool:
    """Put the mmvl equivalent of an MMF switch into ``out``; False when there is none."""
    training = layer.get("training") if isinstance(layer.get("training"), dict) else {}
    if path == ("training", "lr_scheduler") and value is False:
        _put(out, ("scheduler", "type"), None)  # MMF ignores the scheduler block then
        return True
    if path == ("training", "wandb", "enabled") and value is True:
        # the layer's own trackers, else the shipped ones (defaults.yaml and the model/dataset YAMLs)
        trackers = list(training.get("trackers") or (base.get("training") or {}).get("trackers") or [])
        _put(out, ("training", "trackers"), [*trackers, *(["wandb"] if "wandb" not in trackers else [])])
        return True
    if path == ("training", "clip_gradients") and value is False:
        _put(out, ("training", "clip_grad_norm"), None)
        return True
    if path == ("training", "clip_gradients") and value is True and training.get("max_grad_l2_norm") is not None:
        _put(out, ("training", "clip_grad_norm"), training["max_grad_l2_norm"])
        return True
    if len(path) == 3 and path[0] == "model_config" and path[2] in FREEZE_PARTS and value is True:
        _add_frozen(out, path[1], FREEZE_PARTS[path[2]])
        return True
    # the norm was used by clip_gradients above (MMF clips only with clip_gradients: true in the same file)
    return path == ("training", "max_grad_l2_norm") and training.get("clip_gradients") is True


def _add_frozen(out: dict[str, Any], model: str, *parts: Any) -> None:
    """``parts`` join ``model_config.<model>.freeze`` in ``out`` (each once; the list is set even
    when empty, so an empty list still replaces a lower layer's)."""
    node = out.setdefault("model_config", {}).setdefault(model, {})
    node["freeze"] = list(dict.fromkeys([*(node.get("freeze") or []), *parts]))


# -- paths -----------------------------------------------------------------------------------
def _leaves(tree: dict[str, Any], prefix: Path_ = ()) -> list[tuple[Path_, Any]]:
    items: list[tuple[Path_, Any]] = []
    for key, value in tree.items():
        path = (*prefix, str(key))
        if isinstance(value, dict) and value:
            items.extend(_leaves(value, path))
        else:
            items.append((path, value))
    return items


def _native(path: Path_, base: dict[str, Any]) -> bool:
    """``path`` is one of mmvl's own keys (a path below an mmvl value that is not a mapping is not:
    MMF writes some keys mmvl also has, such as ``images``, as a mapping of splits)."""
    node: Any = base
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _match(path: Path_, table: dict[str, Any]) -> tuple[str, Any] | None:
    """The table entry whose pattern is ``path`` or a prefix of it (``*``: any one name)."""
    for pattern, entry in table.items():
        parts = pattern.split(".")
        if len(parts) <= len(path) and all(p in ("*", q) for p, q in zip(parts, path)):
            return pattern, entry
    return None


def _rename(path: Path_, pattern: str, target: str) -> Path_:
    """``target`` with its ``*`` filled from ``path`` (in order), plus what ``path`` has below ``pattern``."""
    parts = pattern.split(".")
    names = iter(q for p, q in zip(parts, path) if p == "*")
    return (*(next(names) if t == "*" else t for t in target.split(".")), *path[len(parts):])


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def _mapped_value(path: Path_, value: Any) -> Any:
    values = VALUES.get(".".join(path))
    return values.get(value, value) if values and isinstance(value, str) else value


def _put(tree: dict[str, Any], path: Path_, value: Any) -> None:
    node = tree
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value
