"""RNG capture and restore: every generator a run draws from, including every GPU's."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from mmvl.utils import rng


def test_round_trip_through_a_weights_only_file(tmp_path):
    state = rng.get_rng_state()
    torch.save({"rng": state}, tmp_path / "r.pt")
    expected = (random.random(), np.random.rand(), torch.rand(2))
    rng.set_rng_state(torch.load(tmp_path / "r.pt", weights_only=True)["rng"])
    got = (random.random(), np.random.rand(), torch.rand(2))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


class _FakeGenerators:
    """Per-GPU generator states on a host without GPUs: what ``torch.cuda`` would report and receive."""

    def __init__(self, monkeypatch, count: int):
        self.states = [torch.full((16,), i, dtype=torch.uint8) for i in range(count)]
        self.restored: list[tuple[int | None, int]] = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": self.states[0])
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: list(self.states))
        monkeypatch.setattr(torch.cuda, "set_rng_state",
                            lambda state, device="cuda": self.restored.append((
                                None if device == "cuda" else int(device), int(state[0]))))


def test_every_visible_gpu_generator_is_saved_and_goes_back_to_its_gpu(monkeypatch):
    """Under dp each replica draws dropout masks from its own GPU's generator: all of them are saved."""
    gpus = _FakeGenerators(monkeypatch, count=3)
    state = rng.get_rng_state()
    assert [int(s[0]) for s in state["cuda"]] == [0, 1, 2]
    rng.set_rng_state(state)
    assert gpus.restored == [(0, 0), (1, 1), (2, 2)]


def test_a_checkpoint_from_a_host_with_more_gpus_restores_the_ones_seen_here(monkeypatch):
    saved = _FakeGenerators(monkeypatch, count=4)
    state = rng.get_rng_state()
    here = _FakeGenerators(monkeypatch, count=2)
    rng.set_rng_state(state)
    assert here.restored == [(0, 0), (1, 1)] and saved.restored == []


def test_older_checkpoints_with_one_gpu_state_still_load(monkeypatch):
    gpus = _FakeGenerators(monkeypatch, count=2)
    state = rng.get_rng_state()
    state["cuda"] = torch.full((16,), 7, dtype=torch.uint8)  # the format before: the current GPU's only
    rng.set_rng_state(state)
    assert gpus.restored == [(None, 7)]


@pytest.mark.cuda
def test_every_gpu_generator_round_trips_on_cuda():
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    for d in devices:
        torch.rand(1, device=d)  # initialise every generator
    state = rng.get_rng_state()
    assert len(state["cuda"]) == len(devices)
    expected = [torch.rand(8, device=d) for d in devices]
    torch.rand(3)
    rng.set_rng_state(state)
    for d, want in zip(devices, expected):
        assert torch.equal(torch.rand(8, device=d), want)
