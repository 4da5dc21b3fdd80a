"""One process, one device: the base behaviour, registered under ``single``."""
from __future__ import annotations

from mmvl.distributed.strategies.base import Strategy
from mmvl.registry import register_strategy


@register_strategy("single")
class SingleStrategy(Strategy):
    """Nothing wrapped; state dicts are the plain module/optimizer ones."""

    name = "single"
