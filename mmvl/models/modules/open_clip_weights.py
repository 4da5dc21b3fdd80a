"""open_clip checkpoints into mmvl's ``clip`` model: the key map, and the loader.

Supported layout: open_clip's ``CLIP`` with a **timm image tower** (``vision_cfg.timm_model_name``,
``timm_proj: linear``, no projection bias) and open_clip's own **text transformer**
(``token_embedding``, ``positional_embedding``, ``transformer.resblocks.*``, ``ln_final``,
``text_projection``, argmax pooling), with or without SigLIP's ``logit_bias``. In mmvl that is
``image_encoder: {type: timm, params: {model_name: <the same>, global_pool: <timm_pool>}}`` and
``text_encoder: {type: transformer, ...}`` with the same sizes. open_clip's own
``VisionTransformer`` tower (``visual.conv1``, ``visual.transformer``, ...) is refused with a
UserError (no mmvl module has its layout).
"""
from __future__ import annotations

from typing import Any

import torch

from mmvl.errors import UserError
from mmvl.models.modules.timm_encoder import read_weights

#: open_clip prefix -> mmvl prefix (first match wins); ``text_projection`` is transposed
PREFIXES = (
    ("visual.trunk.", "image_encoder.model."),
    ("visual.head.proj.", "image_projection."),
    ("token_embedding.", "text_encoder.token_embedding."),
    ("positional_embedding", "text_encoder.positional_embedding"),
    ("transformer.", "text_encoder.transformer."),
    ("ln_final.", "text_encoder.ln_final."),
    ("text_projection", "text_projection.weight"),
    ("logit_scale", "logit_scale"),
    ("logit_bias", "logit_bias"),
)


def open_clip_to_mmvl(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """open_clip's state dict (optionally under ``state_dict``, keys optionally ``module.``-prefixed
    as open_clip_train saves them) with mmvl ``clip``'s key names."""
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for key, value in state.items():
        key = key[len("module."):] if key.startswith("module.") else key
        for theirs, ours in PREFIXES:
            if key.startswith(theirs):
                new = ours + key[len(theirs):]
                if key == "text_projection":
                    value = value.T.contiguous()
                elif key in ("logit_scale", "logit_bias"):
                    value = value.reshape(1)  # open_clip's scalars; mmvl's are [1] (fsdp shards no scalar)
                out[new] = value
                break
        else:
            unknown.append(key)
    if unknown:
        hint = " (open_clip's own VisionTransformer tower is not supported; use a timm tower)" \
            if any(k.startswith("visual.") for k in unknown) else ""
        raise UserError(f"open_clip checkpoint: keys with no place in mmvl's clip, e.g. {unknown[:3]}{hint}.")
    return out


def load_open_clip(model: torch.nn.Module, path: str) -> None:
    """Load an open_clip checkpoint file into ``model`` (mmvl's ``clip``); every tensor must fit."""
    state: Any = read_weights(path, "clip open_clip_weights")
    mapped = open_clip_to_mmvl(state)
    own = model.state_dict()
    missing = [k for k in own if k not in mapped]
    wrong = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in mapped.items()
             if k in own and v.shape != own[k].shape]
    extra = [k for k in mapped if k not in own]
    if missing or wrong or extra:
        raise UserError(f"clip open_clip_weights {path!r} does not fit this configuration: missing {missing[:3]}, "
                        f"shapes {wrong[:2]}, extra {extra[:3]}; match embed_dim, the towers' sizes and "
                        "init_logit_bias (SigLIP) to the checkpoint's.")
    model.load_state_dict(mapped, strict=True)
