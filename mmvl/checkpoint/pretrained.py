"""Matching a state dict to a model: wrapper prefixes, shapes, and prefix maps for pretrained weights.

DDP and ``torch.compile`` prefix parameter names (``module.``, ``_orig_mod.``); a checkpoint saved
under one wrapper loads into a model under another because names are compared without them.
``checkpoint.pretrained_state_mapping`` moves part of a checkpoint (a pretrained encoder) into
another model by renaming key prefixes.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from mmvl.checkpoint.schema import MODEL
from mmvl.errors import UserError

_PREFIXES = ("module.", "_orig_mod.")


def canonical_key(key: str) -> str:
    """``key`` without the ``module.`` / ``_orig_mod.`` prefixes that DDP and torch.compile add."""
    changed = True
    while changed:
        changed = False
        for prefix in _PREFIXES:
            if key.startswith(prefix):
                key, changed = key[len(prefix):], True
    return key


def apply_state_mapping(state: Mapping[str, Any], mapping: Mapping[str, str] | None) -> dict[str, Any]:
    """Rename checkpoint keys by prefix (``checkpoint.pretrained_state_mapping``).

    ``mapping`` is {checkpoint key prefix: model key prefix}; with a non-empty mapping only the
    mapped keys are kept (load the result with strict=False), which is how a pretrained encoder
    is moved into a fine-tuning model.
    """
    if not mapping:
        return dict(state)
    out: dict[str, Any] = {}
    for key, value in state.items():
        canonical = canonical_key(key)
        for src, dst in mapping.items():
            src, dst = str(src).rstrip("."), str(dst or "").rstrip(".")
            if not src or canonical == src or canonical.startswith(src + "."):
                rest = canonical[len(src) + 1:] if src else canonical
                out[".".join(p for p in (dst, rest) if p)] = value
                break
    return out


def match_model_state(model_state: Mapping[str, Any], state: Mapping[str, Any],
                      strict: bool = True) -> tuple[dict[str, Any], list[str], list[str]]:
    """``state`` renamed to the keys of ``model_state`` (a model's own state dict), checked.

    Wrapper prefixes are stripped or added to match. Shape mismatches are listed by key in a
    UserError; with ``strict`` so are missing and unexpected keys. Returns (mapped, missing,
    unexpected).
    """
    by_canonical = {canonical_key(k): k for k in model_state}
    mapped = {by_canonical.get(canonical_key(k), k): v for k, v in state.items()}
    mismatched = [
        f"key {k!r}: checkpoint {tuple(v.shape)} vs model {tuple(model_state[k].shape)}"
        for k, v in mapped.items()
        if k in model_state and isinstance(v, torch.Tensor) and v.shape != model_state[k].shape
    ]
    if mismatched:
        more = f"; ... and {len(mismatched) - 5} more" if len(mismatched) > 5 else ""
        raise UserError(f"checkpoint from another model? {'; '.join(mismatched[:5])}{more}.")
    missing = [k for k in model_state if k not in mapped]
    unexpected = [k for k in mapped if k not in model_state]
    if strict and (missing or unexpected):
        raise UserError(
            f"checkpoint does not match the model: missing {missing[:5]}{'...' if len(missing) > 5 else ''} "
            f"({len(missing)}), unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''} "
            f"({len(unexpected)}); load with strict=False to load the overlap."
        )
    return mapped, missing, unexpected


def load_model_state(model: torch.nn.Module, state: Mapping[str, Any], strict: bool = True) -> tuple[list[str], list[str]]:
    """Load a model state dict (or a checkpoint holding one under ``model``) into a plain module.

    See :func:`match_model_state`; returns (missing, unexpected).
    """
    if isinstance(state.get(MODEL), Mapping):
        state = state[MODEL]
    mapped, missing, unexpected = match_model_state(model.state_dict(), state, strict=strict)
    model.load_state_dict(mapped, strict=False)
    return missing, unexpected


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
