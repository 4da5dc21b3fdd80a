"""Parameter groups: which parameters decay, and each one's learning rate.

Every trainable parameter gets a weight decay and an lr factor, and parameters that agree share a
group (``group``: ``decay`` / ``no_decay``; ``lr_multiplier``: the factor, absent at 1):

- **no decay** for biases, the gains of normalisation layers (LayerNorm, GroupNorm, BatchNorm,
  RMSNorm, any class whose name holds ``Norm``) and the names in ``optimizer.no_weight_decay``
  (by default ``logit_scale`` and ``logit_bias``: a contrastive model's temperature and bias);
- **per-part learning rates**, ``optimizer.param_groups``: a list of rules ``{match, lr_scale}``,
  ``{match, lr}`` (an absolute lr: no other factor applies) and optionally ``weight_decay``;
  ``match`` is a parameter-name prefix (``visual`` matches ``visual.*``) or a glob (``*.bias``,
  ``text.*.ln_*``); the first rule a parameter matches is its rule. A model's own
  ``lr_multipliers()`` multiply in as before;
- **layer-wise lr decay**, ``optimizer.layer_decay`` (< 1): in each tower of numbered blocks
  (timm's ``blocks.N.``, open_clip's ``transformer.resblocks.N.``, BERT's ``layer.N.``) block ``i`` of
  ``N`` learns at ``lr * layer_decay ** (N - i)``; the tower's embeddings (``patch_embed``,
  ``cls_token``, ``pos_embed``, ``conv1``, ``class_embedding``, ``positional_embedding``, ``ln_pre``,
  ``token_embedding``, ...) at ``** (N + 1)``; the rest of the tower (final norm, head) and everything
  outside the towers at the full lr. Towers are told apart by the name before the block index, so
  an image and a text tower each count their own blocks.

Names are the single-device model's (``module.`` and compile prefixes stripped), so a rule means
the same under every strategy.
"""
from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mmvl.errors import UserError

#: where a tower's numbered blocks sit in a parameter name: (tower prefix, block index)
BLOCK = re.compile(r"^(?P<tower>(?:.*\.)?(?:blocks|resblocks|layers|layer))\.(?P<index>\d+)\.")
#: a tower's parts before its first block (they get the deepest decay)
EMBEDDINGS = ("patch_embed", "cls_token", "pos_embed", "reg_token", "dist_token", "conv1", "class_embedding",
              "positional_embedding", "ln_pre", "token_embedding", "embeddings", "word_embeddings")
#: the default of ``optimizer.no_weight_decay``
NO_DECAY_NAMES = ("logit_scale", "logit_bias")


def _is_norm(module: torch.nn.Module) -> bool:
    norm_types = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.modules.batchnorm._NormBase,
                  getattr(torch.nn, "RMSNorm", torch.nn.LayerNorm))
    return isinstance(module, norm_types) or "Norm" in type(module).__name__


def _strip_wrappers(name: str) -> str:
    """``module.bert.x`` -> ``bert.x``: names as the single-device model has them."""
    for prefix in ("module.", "_orig_mod.", "_fsdp_wrapped_module."):
        while name.startswith(prefix):
            name = name[len(prefix):]
    return name.replace("._orig_mod.", ".").replace("._fsdp_wrapped_module.", ".")


def _multiplier(name: str, multipliers: Mapping[str, float]) -> float:
    matches = [p for p in multipliers if name == p or name.startswith(p + ".")]
    return float(multipliers[max(matches, key=len)]) if matches else 1.0


def matches(name: str, pattern: str) -> bool:
    """A glob (holding ``*?[``) matches the whole name; anything else is a prefix of dotted parts
    (``visual`` matches ``visual`` and ``visual.x``, not ``visualiser``), or a last part
    (``logit_scale`` matches ``towers.logit_scale``)."""
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or name.startswith(pattern + ".") or name.endswith("." + pattern)


def check_rules(rules: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """``optimizer.param_groups`` validated: each a ``match`` with exactly one of ``lr_scale``/``lr``
    and optionally ``weight_decay``."""
    out = []
    for i, rule in enumerate(rules or []):
        where = f"optimizer.param_groups[{i}]"
        if not isinstance(rule, Mapping) or not isinstance(rule.get("match"), str) or not rule["match"]:
            raise UserError(f"{where}={rule!r} needs a 'match' (a parameter-name prefix or glob), e.g. "
                            "{match: visual, lr_scale: 0.1}.")
        unknown = set(rule) - {"match", "lr_scale", "lr", "weight_decay"}
        given = [k for k in ("lr_scale", "lr", "weight_decay") if k in rule]
        if unknown or not given or ("lr_scale" in rule and "lr" in rule):
            raise UserError(f"{where}={dict(rule)!r}: give 'match' and one of 'lr_scale' or 'lr' (and/or "
                            f"'weight_decay'){f'; unknown keys {sorted(unknown)}' if unknown else ''}.")
        for key in ("lr_scale", "lr", "weight_decay"):
            if key in rule and (not isinstance(rule[key], (int, float)) or float(rule[key]) < 0):
                raise UserError(f"{where}.{key}={rule[key]!r} must be a number >= 0.")
        out.append(dict(rule))
    return out


def check_every_rule_matches(rules: Sequence[Mapping[str, Any]], names: Sequence[str]) -> None:
    """A rule that matches no parameter of the model (trainable or frozen) is almost always a typo
    in its ``match``: refused, with the model's top-level parts as the hint."""
    for i, rule in enumerate(rules):
        if not any(matches(name, rule["match"]) for name in names):
            parts = sorted({name.split(".")[0] for name in names})
            shown = ", ".join(parts[:8]) + (", ..." if len(parts) > 8 else "")
            raise UserError(f"optimizer.param_groups[{i}].match={rule['match']!r} matches no parameter of the model; "
                            f"use a name prefix or glob of its parameters (top-level parts: {shown}).")


def layer_scales(names: Sequence[str], decay: float) -> dict[str, float]:
    """Each name's layer-wise lr factor (``decay`` < 1; names outside every tower are left out)."""
    if not 0 < decay <= 1:
        raise UserError(f"optimizer.layer_decay={decay} must be in (0, 1] (e.g. 0.75; 1: off).")
    if decay == 1:
        return {}
    blocks: dict[str, int] = {}
    for name in names:
        found = BLOCK.match(name)
        if found:
            tower = found["tower"]
            blocks[tower] = max(blocks.get(tower, 0), int(found["index"]) + 1)
    scales = {}
    for name in names:
        found = BLOCK.match(name)
        if found:
            scales[name] = decay ** (blocks[found["tower"]] - int(found["index"]))
            continue
        best: tuple[tuple[int, int], int] | None = None
        for tower, depth in blocks.items():  # an embedding belongs to the tower it sits closest to
            parts = tower.split(".")[:-1]  # the modules holding the block list, outermost first
            for cut in range(len(parts) + 1):
                root = ".".join(parts[:cut])
                if root and not name.startswith(root + "."):
                    break
                rest = name[len(root) + 1:] if root else name
                key = (cut, -len(parts))  # the deepest anchor, then the shallowest tower
                if rest.split(".")[0] in EMBEDDINGS and (best is None or key > best[0]):
                    best = (key, depth)
        if best is not None:
            scales[name] = decay ** (best[1] + 1)
    if not blocks:
        raise UserError(f"optimizer.layer_decay={decay}: the model has no numbered blocks (blocks.N., "
                        "resblocks.N., layer.N.) to decay; set optimizer.layer_decay=1.0.")
    return scales


def param_groups(model: torch.nn.Module, weight_decay: float | None = None,
                 multipliers: Mapping[str, float] | None = None, rules: Sequence[Mapping[str, Any]] | None = None,
                 no_weight_decay: Sequence[str] = NO_DECAY_NAMES, layer_decay: float = 1.0,
                 base_lr: float | None = None) -> list[dict[str, Any]]:
    """Trainable parameters in groups by (decay, lr factor, weight decay); empty groups dropped.

    ``weight_decay=None`` leaves the decay group on the optimizer's default. A group whose lr is not
    the base lr has ``lr_multiplier`` (and ``lr`` when ``base_lr`` is given).
    """
    rules = check_rules(rules)
    named: list[tuple[str, torch.nn.Module, str, torch.nn.Parameter]] = []
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            named.append((_strip_wrappers(f"{module_name}.{name}" if module_name else name), module, name, p))
    check_every_rule_matches(rules, [_strip_wrappers(n) for n, _ in model.named_parameters()])
    layers = layer_scales([n for n, *_ in named], float(layer_decay))
    groups: dict[tuple[bool, float, Any], list[torch.nn.Parameter]] = {}
    for full, module, name, p in named:
        no_decay = _is_norm(module) or name.endswith("bias") or any(matches(full, n) for n in no_weight_decay)
        rule = next((r for r in rules if matches(full, r["match"])), {})
        if "lr" in rule:
            if not base_lr:
                raise UserError(f"optimizer.param_groups: {{match: {rule['match']}, lr: ...}} needs "
                                "optimizer.params.lr (a base lr) to be set.")
            factor = float(rule["lr"]) / float(base_lr)
        else:
            factor = _multiplier(full, multipliers or {}) * layers.get(full, 1.0) * float(rule.get("lr_scale", 1.0))
        decay_override = None if no_decay else rule.get("weight_decay")
        groups.setdefault((no_decay, factor, decay_override), []).append(p)
    result = []
    for (no_decay, factor, decay_override), params in sorted(groups.items(), key=lambda kv: (
            kv[0][0], kv[0][1], -1.0 if kv[0][2] is None else float(kv[0][2]))):
        group: dict[str, Any] = {"params": params, "group": "no_decay" if no_decay else "decay"}
        if no_decay:
            group["weight_decay"] = 0.0
        elif decay_override is not None:
            group["weight_decay"] = float(decay_override)
        elif weight_decay is not None:
            group["weight_decay"] = float(weight_decay)
        if factor != 1.0:
            group["lr_multiplier"] = factor
            if base_lr is not None:
                group["lr"] = float(base_lr) * factor
        result.append(group)
    return result
