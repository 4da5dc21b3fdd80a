"""Small models and one training loop shared by the single-process reference and the ranks.

The loop uses only Strategy methods, the way the engine does, so a strategy
that matches the reference here matches it in the trainer.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
from omegaconf import OmegaConf

from mmvl.distributed.env import DistEnv
from mmvl.distributed.init import seed_for_init
from mmvl.distributed.strategies import build_strategy
from mmvl.utils.precision import compute_dtype

# FSDP2 warns that the head's output is a view; nothing here modifies outputs in place
warnings.filterwarnings("ignore", message=".*returned a view tensor.*")

DIM = 32
GLOBAL_BATCH = 8
LR = 1e-2
EPS = 1e-3  # large enough that a wrongly scaled gradient changes the update (Adam is otherwise scale-free)


class MLP(torch.nn.Module):
    """Four equal layers, so greedy ZeRO partitions split the state exactly in half."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x

    def shard_units(self) -> list[torch.nn.Module]:
        return list(self.layers)


class TinyTransformer(torch.nn.Module):
    """Two encoder layers (the FSDP shard units) and a head, no dropout (ranks must agree)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(DIM, nhead=2, dim_feedforward=64, dropout=0.0, batch_first=True)
            for _ in range(2))
        self.head = torch.nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def shard_units(self) -> list[torch.nn.Module]:
        return list(self.layers)


MODELS = {"mlp": MLP, "transformer": TinyTransformer}


def make_config(strategy: str, distributed: dict[str, Any] | None = None, **training: Any):
    return OmegaConf.create({"distributed": {"strategy": strategy, **(distributed or {})},
                             "training": dict(training)})


def build(model_name: str, strategy: str, env: DistEnv | None = None,
          distributed: dict[str, Any] | None = None, **training: Any):
    """Model + Adam (two param groups, as real configs have) wrapped by ``strategy``
    (``distributed``: more ``distributed.*`` keys)."""
    env = env or DistEnv()
    seed_for_init(0)
    model = MODELS[model_name]()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=LR, eps=EPS)
    dtype = compute_dtype(training.get("precision", "fp32"))  # what the Engine hands its strategy
    strat = build_strategy(make_config(strategy, distributed, **training), env, dtype)
    model, optimizer = strat.wrap(model, optimizer)
    return strat, model, optimizer


def batch(step: int, model_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of update ``step`` (same on every rank and in the reference)."""
    g = torch.Generator().manual_seed(1000 + step)
    shape = (GLOBAL_BATCH, DIM) if model_name == "mlp" else (GLOBAL_BATCH, 3, DIM)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def train(strat, model, optimizer, model_name: str, steps: range, rank: int = 0, world: int = 1,
          accum: int = 1, clip: float | None = None, sync: bool = True) -> list[float]:
    """Updates over ``steps``; each global batch is split into ``accum`` micro-steps, then across ranks.

    Returns the gradient norms that ``clip_grad_norm_`` reported (empty without clipping).
    """
    norms = []
    for step in steps:
        x, y = batch(step, model_name)
        optimizer.zero_grad(set_to_none=True)  # as the engine does
        micro = GLOBAL_BATCH // accum
        for m in range(accum):
            per_rank = micro // world
            lo = m * micro + rank * per_rank
            xs, ys = x[lo:lo + per_rank], y[lo:lo + per_rank]
            boundary = m == accum - 1
            ctx = strat.no_sync(model) if (not boundary and sync) else contextlib.nullcontext()
            with ctx:
                loss = torch.nn.functional.mse_loss(model(xs), ys) / accum
                loss.backward()
        if clip is not None:
            norms.append(float(strat.clip_grad_norm_(model, optimizer, clip)))
        optimizer.step()
    return norms


def full_params(strat, model) -> dict[str, torch.Tensor]:
    """Full parameters (collective for sharded strategies; valid on rank 0)."""
    return {k: v.detach().clone().cpu() for k, v in strat.model_state_dict(model).items()}


def local_optimizer_state_bytes(optimizer) -> int:
    """Bytes of optimizer state this rank holds (OSS/ZeRO keep their shard in ``.optim``)."""
    inner = getattr(optimizer, "optim", optimizer)
    total = 0
    for entry in inner.state.values():
        for value in entry.values():
            if torch.is_tensor(value):
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total
