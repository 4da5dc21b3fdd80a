"""``training.matmul_precision``: what each setting resolves to per device, and that the Engine hands
the value to torch (once, logged on rank 0 only)."""
from __future__ import annotations

import logging

import pytest
import torch
from omegaconf import OmegaConf

from mmvl.distributed.env import DistEnv
from mmvl.engine import Engine
from mmvl.errors import UserError
from mmvl.utils.precision import matmul_precision


@pytest.mark.parametrize("setting,device,want", [
    ("auto", "cuda", "high"),      # TF32 on CUDA by default
    ("auto", "cpu", None),         # the CPU keeps torch's own setting
    ("highest", "cuda", "highest"),
    ("medium", "cpu", "medium"),   # an explicit value applies on any device
])
def test_resolution(setting, device, want):
    assert matmul_precision(setting, device) == want


def test_an_unknown_setting_is_a_user_error():
    with pytest.raises(UserError, match="training.matmul_precision='tf32'.*auto, highest, high, medium"):
        matmul_precision("tf32", "cuda")


@pytest.mark.parametrize("setting,device,rank,want", [
    ("auto", "cuda", 0, ["high"]),
    ("auto", "cpu", 0, []),
    ("highest", "cuda", 1, ["highest"]),  # every rank sets it; only rank 0 logs
    ("medium", "cpu", 0, ["medium"]),
])
def test_the_engine_passes_it_to_torch(monkeypatch, caplog, setting, device, rank, want):
    calls: list[str] = []
    monkeypatch.setattr(torch, "set_float32_matmul_precision", calls.append)
    config = OmegaConf.create({"training": {"matmul_precision": setting}})
    with caplog.at_level(logging.INFO, logger="mmvl"):
        Engine(config, env=DistEnv(rank=rank, world_size=2, device=torch.device(device)))
    assert calls == want
    said = [r.getMessage() for r in caplog.records if "matmul precision" in r.getMessage()]
    assert len(said) == (1 if want and rank == 0 else 0)
    assert all(f"precision {want[0]} (training.matmul_precision={setting})" in m for m in said)
