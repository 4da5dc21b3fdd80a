import os
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
# torch.compile's kernel cache is per user in /tmp and shared by every process: a compile killed
# mid-write elsewhere left a truncated .so there ("file too short") that failed the compiled tests;
# this session's tests (and the processes they start) compile into a cache of their own
_INDUCTOR_CACHE = None if "TORCHINDUCTOR_CACHE_DIR" in os.environ else tempfile.mkdtemp(prefix="mmvl-tests-inductor-")
if _INDUCTOR_CACHE is not None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


class UnmarkedProcessStart(RuntimeError):
    """A test not marked ``proc`` started a process (the unit tier must start none)."""


_RUNNING: dict[str, object] = {}  # the test item whose setup, call or teardown is running
STARTED: dict[str, list[str]] = {}  # test id -> what it started without the marker


def _guard(what: str) -> None:
    item = _RUNNING.get("item")
    if item is None or any(item.get_closest_marker(m) is not None for m in ("proc", "slow")):
        return  # slow tests are outside the unit tier whatever they start
    STARTED.setdefault(item.nodeid, []).append(what)
    raise UnmarkedProcessStart(f"{item.nodeid} starts a process ({what}) but is not marked proc: add "
                               "@pytest.mark.proc (the unit tier, -m 'not slow and not proc', starts none)")


def _wrap(owner: object, name: str, what: str) -> None:
    original = getattr(owner, name, None)
    if original is None:
        return

    def guarded(*args, **kwargs):
        _guard(what)
        return original(*args, **kwargs)

    setattr(owner, name, guarded)


def pytest_configure(config):
    """Every way a test can start a process goes through a guard that fails unmarked tests.

    Module- and session-scoped fixtures are covered too: they are set up inside the first test
    that asks for them, so that test must be marked ``proc``."""
    import multiprocessing.process
    import subprocess

    _warm_matplotlib_font_cache()
    _wrap(subprocess.Popen, "__init__", "subprocess")
    _wrap(multiprocessing.process.BaseProcess, "start", "multiprocessing: mp.spawn, DataLoader workers")
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "spawnv", "spawnve"):
        _wrap(os, name, f"os.{name}")


def _warm_matplotlib_font_cache() -> None:
    """Build matplotlib's font cache before the guards: on a machine without one (a fresh CI host),
    its first import runs ``fc-list`` in a subprocess, which is matplotlib's doing, not the test's
    that happened to import it first."""
    try:
        import matplotlib.font_manager  # noqa: F401
    except ImportError:
        pass


def pytest_unconfigure(config):
    if _INDUCTOR_CACHE is not None:
        import shutil

        shutil.rmtree(_INDUCTOR_CACHE, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _RUNNING["item"] = item
    try:
        yield
    finally:
        _RUNNING.pop("item", None)


@pytest.fixture(autouse=True)
def _no_process_unless_marked(request):
    """Fail the test (in teardown) if it started a process unmarked, even if it swallowed the error."""
    yield
    started = STARTED.pop(request.node.nodeid, None)
    if started:
        pytest.fail(f"started a process without @pytest.mark.proc: {', '.join(sorted(set(started)))}")


def pytest_collection_modifyitems(config, items):
    """``cuda``-marked tests skip on hosts without a GPU (``pytest -m cuda`` selects them)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is false)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(params=[0o022, 0o002, 0o077], ids=["umask022", "umask002", "umask077"])
def umask(request):
    """Run the test under each umask (the process's, restored after)."""
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)
