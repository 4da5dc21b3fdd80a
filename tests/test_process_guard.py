"""The unit tier starts no process: every way a test could start one fails a test not marked ``proc``."""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

from pathlib import Path

import pytest


@pytest.fixture
def conftest(request):
    """tests/conftest.py as pytest loaded it (a second import would hold a second, unused guard)."""
    path = str(Path(__file__).resolve().parent / "conftest.py")
    return next(p for p in request.config.pluginmanager.get_plugins() if getattr(p, "__file__", None) == path)


@pytest.mark.parametrize("start", [
    lambda: subprocess.run([sys.executable, "-c", "pass"], check=True),
    lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
    lambda: multiprocessing.get_context("fork").Process(target=print).start(),
    lambda: os.fork(),
], ids=["subprocess", "mp_spawn", "mp_fork", "os_fork"])
def test_an_unmarked_test_that_starts_a_process_fails(request, conftest, start):
    with pytest.raises(conftest.UnmarkedProcessStart, match="is not marked proc"):
        start()
    # the guard recorded it, so the test would fail in teardown even had it swallowed the error
    assert conftest.STARTED.pop(request.node.nodeid)


@pytest.mark.proc
def test_a_marked_test_may_start_one():
    assert subprocess.run([sys.executable, "-c", "print('ran')"], capture_output=True, text=True).stdout == "ran\n"
