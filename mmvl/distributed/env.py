"""Where this process sits: rank, world size, device. Filled once by ``init``."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None   # None: no process group

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1
