"""Fixtures for distributed tests: a 2-process gloo launcher (see ``dist_launch.launch``)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # so test modules and spawned ranks can import the helpers

import dist_launch  # noqa: E402


@pytest.fixture
def launch():
    """``launch(fn, world_size=2, args=(), timeout=120)``: run ``fn(env, *args)`` on real gloo ranks."""
    return dist_launch.launch
