"""Two machines for real: two network namespaces joined by a veth pair, one ``mmvl_launch
--num_machines 2`` node in each, meeting at node 0's address (not 127.0.0.1); the run ends where
one machine with the same global batch ends; the same for ``mmvl_run`` under ``torchrun --nnodes 2``. Skipped, with the reason, where namespaces cannot be
made (not root, no ``ip``)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from mmvl.io import safe_load
from tests.engine.test_ports import PORTS, ported
from tests.fixtures.faults import ROOT, SCRIPT, child_env, communicate, free_port
from tests.fixtures.toy import toy_opts

pytestmark = pytest.mark.slow
#: the two nodes' addresses on their veth pair (a private /24 nothing else on the host uses)
ADDRESSES = ("10.231.77.1", "10.231.77.2")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def namespaces():
    """Two namespaces ``(name, interface)``, veth-joined, removed afterwards."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("two network namespaces need root and iproute2's `ip` (CI runs as root)")
    tag = f"{os.getpid() % 100000}"
    names, links = (f"mmvl{tag}a", f"mmvl{tag}b"), (f"mv{tag}a", f"mv{tag}b")
    try:
        for name in names:
            _ip("netns", "add", name)
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for name, link, address in zip(names, links, ADDRESSES):
            _ip("link", "set", link, "netns", name)
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", link)
            _ip("-n", name, "link", "set", link, "up")
            _ip("-n", name, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as e:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        pytest.skip(f"cannot make network namespaces here: {e.stderr.strip()}")
    yield list(zip(names, links))
    for name in names:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _one_machine(argv: list[str]) -> None:
    one = subprocess.run(argv, cwd=ROOT, env=child_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True,
                         timeout=240)
    assert one.returncode == 0, one.stderr[-3000:]


def _two_machines(namespaces, node_argv) -> None:
    """``node_argv(rank, port)`` run in rank's namespace, both to a successful end."""
    port, nodes = str(free_port()), []
    for rank, (name, link) in enumerate(namespaces):
        # gloo finds its own address from the interface named here (the hostname resolves to loopback)
        env = child_env(CUDA_VISIBLE_DEVICES="", GLOO_SOCKET_IFNAME=link)
        nodes.append(subprocess.Popen(["ip", "netns", "exec", name, *node_argv(rank, port)], cwd=ROOT, env=env,
                                      text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      start_new_session=True))
    for result in [communicate(node, 240) for node in nodes]:
        assert result.returncode == 0, result.stderr[-3000:]


def test_two_machines_end_where_one_machine_ends(tmp_path, namespaces):
    script = ported(PORTS / "tracking.py", tmp_path / "port")
    common = ["--cpu", "--no_shuffle", "--output_dir"]
    _one_machine([sys.executable, str(script), "--batch_size", "8", *common, str(tmp_path / "one")])
    _two_machines(namespaces, lambda rank, port: [
        sys.executable, "-m", "mmvl_cli.launch", "--num_machines", "2", "--machine_rank", str(rank),
        "--main_process_ip", ADDRESSES[0], "--main_process_port", port, "--num_processes", "1", str(script),
        "--batch_size", "4", *common, str(tmp_path / "two")])
    first, second = (torch.load(tmp_path / k / "model.pt", weights_only=True) for k in ("one", "two"))
    for key, value in first.items():
        torch.testing.assert_close(second[key], value, atol=1e-5, rtol=0, msg=key)


def test_mmvl_run_under_torchrun_on_two_machines_ends_where_one_machine_ends(tmp_path, namespaces):
    """``mmvl_run`` (the toy config) under ``torchrun --nnodes 2``, one node per namespace, equals the
    one-process run with the same global batch."""
    _one_machine([sys.executable, SCRIPT, *toy_opts(tmp_path / "one", "training.device=cpu")])
    opts = toy_opts(tmp_path / "two", "distributed.strategy=ddp", "training.device=cpu")
    _two_machines(namespaces, lambda rank, port: [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={rank}", "--nproc_per_node=1",
        f"--master_addr={ADDRESSES[0]}", f"--master_port={port}", SCRIPT, *opts])
    first, second = (safe_load(tmp_path / k / "save" / "checkpoints" / "last.ckpt") for k in ("one", "two"))
    assert second["trainer"]["world_size"] == 2
    for key, value in first["model"].items():
        torch.testing.assert_close(second["model"][key], value, atol=1e-5, rtol=0, msg=key)
