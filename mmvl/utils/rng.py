"""Capture and restore every RNG a run draws from, as plain tensors and lists (no pickle)."""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def get_rng_state() -> dict[str, Any]:
    """RNG states of Python, NumPy and torch (CPU and CUDA) in weights-only-loadable form."""
    version, py_state, gauss = random.getstate()
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(py_state, dtype=torch.int64),
                   "gauss": gauss},
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # every visible GPU's generator: under dp each replica draws (dropout) from its own GPU's.
        # A generator's state is a few bytes kept on the host: no GPU is touched to read it.
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    nps = state["numpy"]
    np.random.set_state(("MT19937", nps["keys"].numpy().astype(np.uint32), nps["pos"],
                         nps["has_gauss"], nps["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"]
        if isinstance(saved, torch.Tensor):  # checkpoints before every GPU was saved: the current one
            torch.cuda.set_rng_state(saved)
        else:  # GPU i's state back to GPU i, for the GPUs both runs see
            for index, gpu_state in enumerate(saved[:torch.cuda.device_count()]):
                torch.cuda.set_rng_state(gpu_state, index)


def seed_everything(seed: int, rank: int = 0) -> int:
    """Seed Python, NumPy and torch (every device) with ``seed + rank``; returns the value used.

    ``rank=0`` on every rank gives identical model initialisation; the rank
    added afterwards gives each rank its own dropout and augmentation draws.
    """
    value = (int(seed) + int(rank)) % 2**32
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)
    return value
