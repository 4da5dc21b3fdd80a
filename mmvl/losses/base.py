"""The loss contract, and the helpers the trainer uses to build and apply the configured losses.

A loss is ``cls(**params)``; its instance is called ``loss(batch, output)`` and
returns a scalar tensor averaged over the batch. Losses read
``output["scores"]`` and ``batch["targets"]`` so models and datasets only have
to agree on those two names.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mmvl.config.access import plain
from mmvl.config.components import build_component, component_spec
from mmvl.errors import UserError
from mmvl.registry import LOSSES


class Loss:
    """Base class: checks the tensors it needs exist and names the loss in errors."""

    name = "loss"

    def _get(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        if "scores" not in output:
            raise UserError(
                f"loss {self.name!r} needs output['scores'] but the model returned keys "
                f"{sorted(output)}; return 'scores' from forward() or drop this loss from losses:."
            )
        if "targets" not in batch:
            raise UserError(
                f"loss {self.name!r} needs batch['targets'] but the batch has keys {sorted(batch)}; "
                "the dataset must yield 'targets' (or remove this loss for this dataset)."
            )
        return output["scores"], batch["targets"]

    def __call__(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError


def build_losses(loss_configs: Sequence[Any] | None) -> list[tuple[str, Loss]]:
    """``[{type, params}, ...]`` (or plain names) -> ``[(name, loss), ...]``.

    Names are the types; a repeated type gets ``_1``, ``_2``... so every entry
    in the logged loss dict is distinct.
    """
    out: list[tuple[str, Loss]] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(plain(loss_configs) or []):
        loss = build_component(LOSSES, entry, where=f"losses[{i}]")
        type_ = component_spec(entry, f"losses[{i}]")[0]
        count = seen.get(type_, 0)
        seen[type_] = count + 1
        out.append((type_ if count == 0 else f"{type_}_{count}", loss))
    return out


def compute_losses(losses: Sequence[tuple[str, Any]], batch: Mapping[str, Any],
                   output: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Every configured loss plus any ``output["losses"]`` the model returned.

    Model-computed losses come first; a name used by both is an error rather
    than a silent overwrite. The trainer sums the values for backward; an empty
    dict means there is nothing to optimise (the trainer should say so in training).
    """
    result: dict[str, torch.Tensor] = {}
    model_losses = output.get("losses")
    if model_losses is not None:
        if not isinstance(model_losses, Mapping):
            raise UserError(f"model output['losses'] must be a dict of name -> scalar tensor, got "
                            f"{type(model_losses).__name__}.")
        for name, value in model_losses.items():
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise UserError(f"model output['losses'][{name!r}] must be a scalar tensor, got "
                                f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}.")
            result[str(name)] = value.reshape(())
    for name, loss in losses:
        if name in result:
            raise UserError(f"loss {name!r} is both returned by the model in output['losses'] and listed "
                            "in losses:; remove one of them.")
        result[name] = loss(batch, output)
    return result
