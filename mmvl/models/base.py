"""The model contract: single-device code, a dict in and a dict out.

``forward(batch)`` returns at least ``{"scores": Tensor}``. Losses are computed
by the trainer from ``model_config.<name>.losses`` unless the model returns a
``losses`` dict itself. Models never know about ranks or parallel wrappers.

Freezing (``model_config.<name>.freeze: [<part>, ...]``) is implemented once, here: a model
declares its parts (``PARTS``: part name -> sub-module names) and its scoring head (``HEAD``),
and ``base`` is everything outside the head (MMF's ``freeze_base``). Frozen parameters get
``requires_grad=False`` before the optimizer and any parallel wrapper see them, so they get no
gradient, no optimizer state and no all-reduce.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

import torch
from omegaconf import DictConfig

from mmvl.errors import UserError
from mmvl.adapters import is_adapter
from mmvl.utils.activation_checkpointing import checkpoint_each

#: the part every model with a ``HEAD`` offers: all parameters outside the head
BASE_PART = "base"


class BaseModel(torch.nn.Module):
    """Base class for registered models (``@registry.register_model``)."""

    #: default YAML (relative to the repo's ``configs/``)
    config_path: str | None = None
    #: part name -> the sub-modules (dotted attribute names) ``freeze: [part]`` freezes; names this
    #: configuration did not build (e.g. an image encoder when region features are read) are skipped
    PARTS: ClassVar[dict[str, tuple[str, ...]]] = {}
    #: the sub-modules that score; ``base`` freezes everything else
    HEAD: ClassVar[tuple[str, ...]] = ()
    #: whether an update may leave some trainable parameters without a gradient (DDP must then look
    #: for them: ``distributed.find_unused_parameters``)
    leaves_parameters_unused: ClassVar[bool] = False
    #: the attribute holding a whole transformers model whose adapters export as one peft folder (None:
    #: each adapted part's module is its own base, e.g. ``vlm``'s language model)
    ADAPTER_ROOT: ClassVar[str | None] = None
    #: set by a strategy whose every forward is a collective per shard unit (FSDP): then each part must
    #: run in every forward, on every rank, even where the batch does not need it (a batch without images)
    every_part_each_forward: bool = False
    #: whether forward takes packed rows (``training.packing``, :mod:`mmvl.data.packing`): several samples a row,
    #: ``position_ids`` restarting at each, the images in placeholder order
    packs_samples: ClassVar[bool] = False

    def __init__(self, config: DictConfig):
        super().__init__()
        self.config = config

    def forward(self, batch: dict[str, Any]) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def enable_gradient_checkpointing(self) -> None:
        """Turn on activation checkpointing in the model's encoders (``training.gradient_checkpointing``
        in one process; under fsdp the strategy checkpoints :meth:`shard_units`). This default
        checkpoints the shard units, the modules fsdp would: a model overrides it to use its
        encoders' own switches (transformers' layers, timm's)."""
        checkpoint_each(self.shard_units())

    def checkpointable(self) -> bool:
        """Whether ``training.gradient_checkpointing`` has anything to recompute here: shard units,
        or a switch of the model's own."""
        own = type(self).enable_gradient_checkpointing is not BaseModel.enable_gradient_checkpointing
        return own or bool(self.shard_units())

    def lr_multipliers(self) -> dict[str, float]:
        """Parameter-name prefix -> multiple of ``optimizer.params.lr`` (e.g. ``{"bert": 0.1}``).

        Lets a pretrained encoder be fine-tuned gently while new layers learn at the full rate.
        """
        return {}

    def shard_units(self) -> list[torch.nn.Module]:
        """Sub-modules that FSDP shards one by one (e.g. transformer layers)."""
        return []

    # -- freezing -------------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        """The name users write in ``model_config.<name>`` (from ``config_path``)."""
        return Path(self.config_path).stem if self.config_path else type(self).__name__

    def part_parameters(self) -> dict[str, list[str]]:
        """Part -> the names of the parameters it holds in this configuration (parts holding none,
        in this configuration, are left out: freezing them would do nothing)."""
        names = [n for n, _ in self.named_parameters()]
        out: dict[str, list[str]] = {}
        for part, prefixes in self.PARTS.items():
            held = [n for n in names if under_prefix(n, prefixes)]
            if held:
                out[part] = held
        if self.HEAD:
            base = [n for n in names if not under_prefix(n, self.HEAD)]
            if base:
                out[BASE_PART] = base
        return out

    def freeze(self, parts: Iterable[str] | str | None) -> list[str]:
        """Set ``requires_grad=False`` on every parameter of ``parts``; returns the parts frozen.

        Freezing a part freezes its own weights, never LoRA adapters put into it: they are what
        ``lora`` added to train (``freeze: [base]`` with LoRA on the LM trains the projector and the
        adapters). A part the model does not offer (or holds no parameters in this configuration)
        is a UserError naming it and listing the parts there are.
        """
        wanted = [parts] if isinstance(parts, str) else [str(p) for p in parts or []]
        offered = self.part_parameters()
        where = f"model_config.{self.model_name}.freeze"
        for part in wanted:
            if part in offered:
                continue
            listing = ", ".join(offered) or "none"
            if part in self.PARTS:
                raise UserError(f"{where}: part {part!r} has no parameters in this configuration; the parts "
                                f"here are {listing}.")
            raise UserError(f"{where}: unknown part {part!r}; {self.model_name} offers {listing}.")
        frozen = {n for part in wanted for n in offered[part]}
        for name, p in self.named_parameters():
            if name in frozen and not is_adapter(name):
                p.requires_grad_(False)
        return list(dict.fromkeys(wanted))


def under_prefix(name: str, prefixes: Iterable[str]) -> bool:
    """Whether parameter ``name`` lies in one of the modules ``prefixes`` names."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def trainable_summary(model: torch.nn.Module, frozen: list[str], adapted: list[str] = ()) -> str:
    """``training 1,234 of 5,678 parameters (frozen: text_encoder; LoRA on language_model: 456 adapter
    parameters)``: what the run log says (adapters are the parameters named ``lora_``, peft's naming)."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    notes = [f"frozen: {', '.join(frozen)}"] if frozen else []
    if adapted:
        adapters = sum(p.numel() for n, p in model.named_parameters() if is_adapter(n))
        notes.append(f"LoRA on {', '.join(adapted)}: {adapters:,} adapter parameters")
    note = f" ({'; '.join(notes)})" if notes else ""
    return f"training {trainable:,} of {total:,} parameters{note}"
