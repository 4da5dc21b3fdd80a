"""How a run continues from a checkpoint, and when it must not do so silently.

``checkpoint.resume`` (auto | true | false) and ``checkpoint.resume_file`` pick a checkpoint
(:meth:`mmvl.checkpoint.CheckpointManager.choose_resume`). A training run resumes it only
under the config it was saved with: keys the typed config declares safe (``knob(..., safe=True)``
in :mod:`mmvl.config.schema`: how long, how often, where, how fast, how it is logged) may differ; any other difference stops the run with one
line listing the keys, unless ``checkpoint.reset.{optimizer,scheduler,counts}`` says to take
the weights on under the new settings. ``checkpoint.resume=false`` starts over and moves the
old checkpoints aside. ``checkpoint.resume_pretrained`` copies only model weights (through
``checkpoint.pretrained_state_mapping``) into the model before it is wrapped.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from mmvl import io
from mmvl.checkpoint import apply_state_mapping, canonical_key, load_checkpoint, load_model_state, schema
from mmvl import registry
from mmvl.checkpoint import sharded as sharded_dir
from mmvl.config.components import component_yaml
from mmvl.config.files import read_yaml
from mmvl.config.load import config_root
from mmvl.config.schema import reset_needed, resume_safe, stages
from mmvl.engine import Engine
from mmvl.errors import UserError
from mmvl.adapters import is_adapter
from mmvl.checkpoint.pretrained import onto_adapted
from mmvl.optim import adopt_config_hyperparameters

log = logging.getLogger("mmvl")

RESETS = ("optimizer", "scheduler", "counts")


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, Mapping) and tree:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any],
                   defaults: Mapping[str, Any] | None = None) -> list[tuple[str, Any, Any]]:
    """``(key, old, new)`` for every key the schema does not declare resume-safe whose value differs.

    A key the old config lacks (saved by an mmvl without it) counts as changed only when its
    new value differs from ``defaults`` (the shipped default); a key only the old one has is
    ignored (dropped from mmvl).
    """
    before, after = _flatten(old), _flatten(new)
    shipped = _flatten(defaults or {})
    changes = []
    for key in sorted(after, key=_weight):
        if resume_safe(key):
            continue
        if key in before:
            if before[key] != after[key]:
                changes.append((key, before[key], after[key]))
        elif key not in shipped or shipped[key] != after[key]:
            changes.append((key, "(unset)", after[key]))
    return changes


#: what a config change means most for a resume, first: which model, on which data, then their sections
_FIRST = ("model", "datasets", "model_config.", "dataset_config.")


def _weight(key: str) -> tuple[int, str]:
    """Sort key: :data:`_FIRST` in its order, then the rest alphabetically."""
    return next((i for i, p in enumerate(_FIRST) if key == p or (p.endswith(".") and key.startswith(p))),
                len(_FIRST)), key


def _shipped_defaults() -> dict[str, Any]:
    """defaults.yaml with every registered model's YAML (built-in or ``env.user_dir``'s, by its
    ``config_path``): a key a model gained after the checkpoint was written, at its default there, is
    what the old run did, not a change."""
    try:
        root = config_root()
        tree = read_yaml(root / "defaults.yaml", "Defaults file")
        models = tree.setdefault("model_config", {})
        for name in registry.MODELS.names():
            path = component_yaml("model", name, root)
            if path is not None:
                models.update(read_yaml(path, "Model defaults file").get("model_config") or {})
        return tree
    except UserError:
        return {}


def _describe(changes: list[tuple[str, Any, Any]], limit: int | None = 3, rest: str = "", width: int = 80) -> str:
    """The first changes (at most ``limit``, the second and third only while within ``width``
    characters, values cut short), then how many more (``rest``: where they are); ``limit=None``:
    all of them, in full (for train.log)."""
    def say(value: Any) -> str:
        text = value if value == "(unset)" else repr(value)
        return text if limit is None or len(text) <= 40 else text[:37] + "..."

    shown: list[str] = []
    for key, old, new in changes[:limit]:
        item = f"{key} ({say(old).strip('()') if old == '(unset)' else say(old)} -> {say(new)})"
        if shown and limit is not None and len(", ".join([*shown, item])) > width:
            break
        shown.append(item)
    more = len(changes) - len(shown)
    return ", ".join(shown) + (f" and {more} more{rest}" if more else "")


def check_resume_config(state: Mapping[str, Any], config: Any, path: str, resets: list[str],
                        announce: bool = True) -> None:
    """Refuse to resume ``state`` under a config that differs outside the safe keys, unless a
    reset switch takes the weights on under the new settings (then ``announce`` logs them)."""
    saved = state.get(schema.CONFIG)
    if not isinstance(saved, Mapping):
        log.info("%s holds no config; resuming without comparing configs", path)
        return
    changes = config_changes(saved, OmegaConf.to_container(config, resolve=True), _shipped_defaults())
    if not changes:
        return
    needed = sorted({r for k, _, _ in changes if (r := reset_needed(k)) and r not in resets})
    if resets and needed:
        keys = [c for c in changes if reset_needed(c[0]) in needed]
        raise UserError(f"{_describe(keys)} changed since {path} was saved; resume with "
                        f"{' and '.join(f'checkpoint.reset.{r}=true' for r in needed)} (the saved state "
                        "belongs to the old setting), or start over in a new env.save_dir.")
    if resets:
        if announce:
            log.warning("Resuming the weights of %s under changed settings (checkpoint.reset.%s): %s",
                        path, "/".join(resets), _describe(changes, limit=None))
        return
    said = _describe(changes, rest=" (all in train.log)")
    if announce and said.endswith("(all in train.log)"):  # the line shows a few; train.log keeps them all
        log.warning("every config difference from %s: %s", path, _describe(changes, limit=None))
    raise UserError(
        f"{path} is from another config: {said}. Use another "
        "env.save_dir, checkpoint.resume=false (start over) or checkpoint.reset.optimizer/scheduler/counts=true.")


def weights_mismatch(state: Mapping[str, Any], config: Any, path: str, err: UserError) -> UserError:
    """``err`` (the weights do not fit the model) said as what the checkpoint is: its own config
    names the model and datasets it was trained with (a run that does not train compares no configs)."""
    saved = state.get(schema.CONFIG)
    if not isinstance(saved, Mapping) or "checkpoint from another model?" not in str(err):
        return err
    first = str(err).split("? ", 1)[1].split("; ")[0].rstrip(".")
    was_model, now_model = saved.get("model"), config.get("model")
    was_data, now_data = (", ".join(map(str, d or [])) for d in (saved.get("datasets"), config.get("datasets")))
    if was_model != now_model:
        return UserError(f"{path} holds a {was_model} model and this run builds {now_model} ({first}); point "
                         f"checkpoint.resume_file at a {now_model} checkpoint, or run with model={was_model}.")
    if was_data != now_data:
        return UserError(f"{path} holds {was_model} trained on {was_data}, sized for that data, and this run is on "
                         f"{now_data} ({first}); use a checkpoint trained on {now_data}, or fine-tune from this one "
                         "with checkpoint.resume_pretrained=true.")
    sized = [c for c in config_changes(saved, OmegaConf.to_container(config, resolve=True)) if c[0].startswith(
        "model_config.")]
    if sized:
        return UserError(f"{path} was trained with other model settings, {_describe(sized)} ({first}); set them as "
                         "the checkpoint has them, or use a checkpoint of these settings.")
    return err


def apply_resets(state: dict[str, Any], resets: list[str]) -> dict[str, Any]:
    """The checkpoint without what ``checkpoint.reset.*`` starts afresh: the optimizer state, the
    scheduler state, or the counters (update, best value, data position, callback state)."""
    state = dict(state)
    if "optimizer" in resets:
        state.pop(schema.OPTIMIZER, None)
    if "scheduler" in resets:
        state.pop(schema.SCHEDULER, None)
    if "counts" in resets:
        state[schema.TRAINER] = {**state[schema.TRAINER], schema.UPDATE: 0, schema.BEST_VALUE: None,
                                 schema.BEST_UPDATE: None}
        state.pop(schema.DATA, None)
        state.pop(schema.CALLBACKS, None)
    return state


def resume(trainer: Any) -> str | None:
    """Resume ``trainer`` in full from the checkpoint ``checkpoint.*`` asks for; returns its path.

    Rank 0 chooses (full file or complete sharded directory, whichever is newest) and
    broadcasts the choice; every rank then checks that it can read it and all agree
    before any collective load.
    """
    ck, engine = trainer.config.checkpoint, trainer.engine
    training = "train" in stages(trainer.config)
    pretrained = bool(ck.get("resume_pretrained"))
    resets = [name for name in RESETS if (ck.get("reset") or {}).get(name)]

    def choose() -> str | None:
        found = trainer.checkpoints.choose_resume(
            ck.get("resume", False), ck.get("resume_file"), bool(ck.get("resume_best")), pretrained,
            engine.can_load_sharded(optimizer="optimizer" not in resets))
        if found is None and training and str(ck.get("resume")).lower() == "false":
            moved = trainer.checkpoints.move_aside()
            if moved is not None:
                log.info("checkpoint.resume=false: moved the previous checkpoints and metrics to %s", moved)
        return None if found is None else str(found)

    path = engine.on_main_agreed(choose, "choose the checkpoint to resume from")
    if path is None:
        return None
    sharded = Path(path).is_dir()
    state, problem = None, None
    try:
        if sharded:
            sharded_dir.check_complete(path)
            state = schema.upgrade(io.safe_load(Path(path, schema.SHARDED_STATE), expect_keys=(schema.TRAINER,)))
        else:
            state = load_checkpoint(path)
        if training:
            check_resume_config(state, trainer.config, path, resets, announce=trainer.env.is_main_process)
    except UserError as e:
        problem = str(e)
    engine.all_ranks_agreed(problem, f"resume from {path}")
    state = apply_resets(state, resets)
    keep_optimizer = "optimizer" not in resets
    fresh = [{k: v for k, v in g.items() if k != "params"} for g in trainer.optimizer.param_groups]
    if sharded:
        engine.load_sharded(path, optimizer=keep_optimizer)  # collective
    try:
        trainer.load_state_dict(state)  # the same state on every rank: all fail alike
    except UserError as e:
        raise weights_mismatch(state, trainer.config, path, e) from None
    if resets:
        adopt_config_hyperparameters(trainer.optimizer, trainer.scheduler, fresh,
                                     kept_optimizer=keep_optimizer, kept_scheduler=schema.SCHEDULER in state)
    saved_world = schema.world_size_of(state, trainer.env.world_size)
    if sharded and saved_world != trainer.env.world_size:
        log.info("Re-sharded %s from %d to %d processes", path, saved_world, trainer.env.world_size)
    log.info("Resumed from %s at update %d%s", path, trainer.state.update,
             f" (reset: {', '.join(resets)})" if resets else "")
    return path


def load_pretrained(engine: Engine, model: torch.nn.Module, checkpoint: Any) -> str | None:
    """``checkpoint.resume_pretrained``: copy the model weights of ``checkpoint.resume_file`` into
    ``model`` (single-device, before any wrapping), renamed by ``checkpoint.pretrained_state_mapping``;
    ``checkpoint`` is the config's ``checkpoint`` section.

    Counters, optimizer and scheduler start fresh. Every rank calls this; all agree on errors:
    a mapping prefix that matches no checkpoint key, mapped keys the model lacks, and model keys
    left without weights (all of them without a mapping; those under a mapped model prefix with one).
    """
    if not checkpoint.get("resume_pretrained"):
        return None
    problem, path = None, str(checkpoint.get("resume_file") or "")
    try:
        _load_pretrained(model, path, dict(checkpoint.get("pretrained_state_mapping") or {}))
    except UserError as e:
        problem = str(e)
    engine.all_ranks_agreed(problem, "load the pretrained weights")
    return path


def _load_pretrained(model: torch.nn.Module, path: str, mapping: dict[str, str]) -> None:
    if not path:
        raise UserError("checkpoint.resume_pretrained=true needs checkpoint.resume_file=<a .ckpt file with the "
                        "pretrained weights>.")
    if Path(path).is_dir():
        raise UserError(f"checkpoint.resume_pretrained reads full checkpoint files, and {path!r} is a sharded "
                        "directory; use that run's best.ckpt or last.ckpt.")
    state = io.safe_load(path, expect_keys=())
    weights = state[schema.MODEL] if isinstance(state.get(schema.MODEL), Mapping) else state  # or a bare state dict
    if not weights or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise UserError(f"{path} holds no model weights (neither a 'model' state dict nor a dict of tensors).")
    names = [canonical_key(k) for k in weights]
    unmatched = [src for src in mapping if not any(n == src.rstrip(".") or n.startswith(src.rstrip(".") + ".")
                                                   for n in names)]
    if unmatched:
        prefixes = sorted({n.split(".")[0] for n in names})
        raise UserError(f"checkpoint.pretrained_state_mapping: {unmatched} match no key of {path} "
                        f"(its top-level prefixes: {prefixes[:10]}); fix the checkpoint prefixes.")
    model_keys = [canonical_key(k) for k in model.state_dict()]
    mapped = onto_adapted({canonical_key(k): v for k, v in apply_state_mapping(weights, mapping).items()}, model_keys)
    known = set(model_keys)
    unexpected = [k for k in mapped if k not in known]  # mapped keys are canonical already
    if unexpected:
        raise UserError(f"after checkpoint.pretrained_state_mapping, {len(unexpected)} keys of {path} are not in "
                        f"the model: {unexpected}; fix the mapping's model prefixes (model keys look like "
                        f"{model_keys[:3]}).")
    targets = [str(d or "").rstrip(".") for d in mapping.values()]
    covered = set(mapped)
    missing = [k for k in model_keys if k not in covered and not is_adapter(k) and (not mapping or any(
        t and (k == t or k.startswith(t + ".")) for t in targets))]
    if missing:
        hint = ("to load part of the weights set checkpoint.pretrained_state_mapping={<checkpoint prefix>: "
                "<model prefix>}" if not mapping else "map a checkpoint prefix that holds them")
        raise UserError(f"{path} has no weights for {len(missing)} model keys {missing}; {hint}.")
    load_model_state(model, mapped, strict=False)
    fresh = [k for k in model_keys if k not in covered]
    log.info("Loaded %d pretrained tensors from %s%s", len(mapped), path,
             f"; {len(fresh)} keep their initialisation (e.g. {fresh[:3]})" if fresh else "")
