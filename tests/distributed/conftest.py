"""Fixtures for distributed tests.

``launch`` is the reusable 2-process gloo launcher (see ``dist_launch.launch``).
``dist_group`` spawns ONE 2-rank group per session that runs every strategy's
and the collectives' checks (``dist_checks.run_all``); test classes read their
part of its results. That group runs under the checking shim claiming NCCL
(``comm_shim``): a collective given a tensor NCCL could not take, or run on
another rank's GPU, fails the plan it belongs to. ``references`` holds the single-process runs they are
compared with.
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # so test modules and spawned ranks can import the helpers

import dist_launch  # noqa: E402

GROUP_TIMEOUT_S = 300  # whole-group limit: a hung rank fails the tests instead of hanging them


@pytest.fixture
def launch():
    """``launch(fn, world_size=2, args=(), timeout=120)``: run ``fn(env, *args)`` on real gloo ranks."""
    return dist_launch.launch


@pytest.fixture(scope="session")
def references(tmp_path_factory):
    """Single-process results per model, plus a world-1 checkpoint at the half-way update."""
    import torch

    from dist_checks import PLANS, reference

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks run single-threaded too
    try:
        models = sorted({model for model, _ in PLANS.values()})
        return {m: reference(m, str(tmp_path_factory.mktemp(f"ref_{m}"))) for m in models}
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def dist_group(references, tmp_path_factory):
    """Per-rank results of ``dist_checks.run_all`` from one spawned 2-rank gloo group."""
    from dist_checks import run_all

    workdir = str(tmp_path_factory.mktemp("group"))
    ckpts = {m: r["world1_ckpt"] for m, r in references.items()}
    ranks = dist_launch.launch(run_all, world_size=2, args=(ckpts, workdir), timeout=GROUP_TIMEOUT_S,
                               claim="nccl")
    return {"workdir": workdir, "ranks": ranks}


def pytest_generate_tests(metafunc):
    """``key``: the ``distributed.*`` keys the class's strategy honours (``dist_checks.KEYS``)."""
    if "key" in metafunc.fixturenames and getattr(metafunc.cls, "strategy", None):
        from dist_checks import KEYS

        metafunc.parametrize("key", KEYS.get(metafunc.cls.strategy, ()))
