"""The model contract: single-device code, a dict in and a dict out.

``forward(batch)`` returns at least ``{"scores": Tensor}``. Losses are computed
by the trainer from ``model_config.<name>.losses`` unless the model returns a
``losses`` dict itself. Models never know about ranks or parallel wrappers.
"""
from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig


class BaseModel(torch.nn.Module):
    """Base class for registered models (``@registry.register_model``)."""

    #: default YAML (relative to the repo's ``configs/``)
    config_path: str | None = None

    def __init__(self, config: DictConfig):
        super().__init__()
        self.config = config

    def forward(self, batch: dict[str, Any]) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def enable_gradient_checkpointing(self) -> None:
        """Turn on activation checkpointing in the model's encoders (``training.gradient_checkpointing``)."""

    def lr_multipliers(self) -> dict[str, float]:
        """Parameter-name prefix -> multiple of ``optimizer.params.lr`` (e.g. ``{"bert": 0.1}``).

        Lets a pretrained encoder be fine-tuned gently while new layers learn at the full rate.
        """
        return {}

    def shard_units(self) -> list[torch.nn.Module]:
        """Sub-modules that FSDP shards one by one (e.g. transformer layers)."""
        return []
