"""The cause of the flake "ranks [1] died without a Python error (exit codes [-6])" / "terminate called
without an active exception": a rank shut its interpreter down while gloo's worker threads were still
releasing finished collectives whose tensors Python had already dropped. That release takes the GIL;
CPython ends a thread taking the GIL during shutdown with ``pthread_exit``, which inside the (noexcept)
destructor is ``std::terminate`` (SIGABRT). ``destroy_process_group`` does not stop those threads once
DDP/FSDP hold the backend, so mmvl's commands and the test launcher now end a distributed process with
``exit_process``: barrier, destroy, flush, no interpreter shutdown.

The callback below widens the race that every run has at its end: it leaves gloo collectives in flight
on tensors Python drops at once, and lets the main thread keep the GIL for half a second at a time (the
switch interval), so the worker threads are still releasing them when the command ends. Before the fix
this ended a rank with SIGABRT in 4 of 4 tries here; the backtrace is the flake's (gloo runLoop ->
~AsyncAllreduceWork -> TensorImpl::decref_pyobject -> take_gil -> pthread_exit -> std::terminate).
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.fixtures.faults import ROOT, child_env, free_port
from tests.fixtures.toy import toy_opts

LAG = """
import sys

import torch
import torch.distributed as dist

from mmvl import registry
from mmvl.trainers.callbacks import Callback
from tests.fixtures.toy import register

register()


class GlooLag(Callback):
    def on_train_end(self):
        sys.setswitchinterval(0.5)
        for _ in range(300):
            dist.all_reduce(torch.ones(64), async_op=True)  # Python keeps neither work nor tensor


if "gloo_lag" not in registry.CALLBACKS:
    registry.CALLBACKS.register("gloo_lag", GlooLag)
"""


def _torchrun(*opts: str) -> subprocess.CompletedProcess:
    """The real command under torchrun: ``python -m torch.distributed.run ... -m mmvl_cli.run``."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--monitor-interval=0.2",
            "-m", "mmvl_cli.run", *opts]
    return subprocess.run(argv, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # starts and kills processes: with the slow tests, which CI runs too
def test_a_rank_ends_cleanly_with_gloo_work_in_flight(tmp_path):
    package = tmp_path / "mmvl_gloo_lag"
    package.mkdir()
    (package / "__init__.py").write_text(LAG)
    proc = _torchrun(*toy_opts(tmp_path, f"env.user_dir={package}", "run_type=train", "distributed.strategy=ddp",
                               "training.device=cpu", "training.max_updates=2",
                               "training.callbacks=[{type: gloo_lag}]"))
    assert "terminate called without an active exception" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == 0, proc.stderr[-2000:]
