"""SLURM host lists and task layout, from simulated environments (no scontrol, no processes)."""
from __future__ import annotations

import pytest

from mmvl.distributed.slurm import DEFAULT_PORT_BASE, detect_slurm, expand_nodelist
from mmvl.errors import UserError


@pytest.mark.parametrize("nodelist,hosts", [
    ("node01", ["node01"]),
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("gpu[8-11]", ["gpu8", "gpu9", "gpu10", "gpu11"]),
    ("a[009-011]", ["a009", "a010", "a011"]),
    ("rack[1-2]-n[3,5]", ["rack1-n3", "rack1-n5", "rack2-n3", "rack2-n5"]),
    ("x1, y2", ["x1", "y2"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[01-03", "node01]", "node[a-b]", "node[5-2]"])
def test_malformed_nodelist_is_a_user_error(bad):
    with pytest.raises(UserError, match="SLURM node list"):
        expand_nodelist(bad)


def slurm_env(**extra: str) -> dict[str, str]:
    env = {"SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "SLURM_NTASKS_PER_NODE": "4", "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_JOB_ID": "123456"}
    env.update(extra)
    return env


def test_layout_from_environment():
    layout = detect_slurm(env=slurm_env())
    assert (layout.rank, layout.world_size, layout.local_rank, layout.local_world_size) == (5, 8, 1, 4)
    assert layout.master_addr == "node01" and layout.hosts == ["node01", "node02"]
    assert layout.master_port == DEFAULT_PORT_BASE + 123456 % 20000


def test_step_nodelist_wins_and_port_sources():
    env = slurm_env(SLURM_STEP_NODELIST="gpu[7-8]")
    assert detect_slurm(env=env).master_addr == "gpu7"
    assert detect_slurm(port=29511, env=env).master_port == 29511
    assert detect_slurm(port=-1, env={**env, "MASTER_PORT": "23000"}).master_port == 23000


@pytest.mark.parametrize("value,node,want", [("4(x2)", 1, 4), ("2(x2),1", 2, 1), ("3,5", 1, 5)])
def test_tasks_per_node_formats(value, node, want):
    env = slurm_env(SLURM_NTASKS_PER_NODE="", SLURM_TASKS_PER_NODE=value, SLURM_NODEID=str(node))
    assert detect_slurm(env=env).local_world_size == want


def test_outside_slurm_or_single_task():
    assert detect_slurm(env={}) is None
    assert detect_slurm(env=slurm_env(SLURM_NTASKS="1")) is None


def test_missing_rank_variable_is_a_user_error():
    env = slurm_env()
    del env["SLURM_PROCID"]
    with pytest.raises(UserError, match="SLURM_PROCID is not set"):
        detect_slurm(env=env)
