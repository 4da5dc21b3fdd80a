"""Sharded (FSDP/DCP) checkpoints are complete only when every rank's part and rank 0's marker are
written: a directory a crash left without the marker, or with a part missing or cut short, is
refused by ``mmvl.engine.load_sharded`` and skipped by ``CheckpointManager.latest_sharded``."""
from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from mmvl import io
from mmvl.checkpoint import CheckpointManager, sharded
from mmvl.engine import load_sharded, save_sharded
from mmvl.errors import UserError
from tests.distributed.dist_launch import LaunchError, launch
from tests.distributed.dist_models import build, full_params, train


# -- the marker protocol, on fabricated directories ---------------------------------------------------
def _parts(directory, sizes=(10, 20)):
    directory.mkdir(parents=True)
    for rank, size in enumerate(sizes):
        (directory / f"__{rank}_0.distcp").write_bytes(b"x" * size)
    (directory / ".metadata").write_bytes(b"m")
    return directory


def test_marker_lists_parts_and_detects_damage(tmp_path):
    d = _parts(tmp_path / "sharded_4")
    assert "no COMPLETE.json" in sharded.problem(d)
    with pytest.raises(UserError, match="sharded_4.*incomplete.*no COMPLETE.json"):
        sharded.check_complete(d)
    io.mark_complete(d, world_size=2)
    info = json.loads((d / io.MARKER).read_text())
    assert info == {"world_size": 2, "files": {".metadata": 1, "__0_0.distcp": 10, "__1_0.distcp": 20}}
    sharded.check_complete(d)  # complete now
    (d / "__1_0.distcp").write_bytes(b"x" * 7)  # a part cut short afterwards
    assert "__1_0.distcp has 7 bytes, expected 20" in sharded.problem(d)
    (d / "__1_0.distcp").unlink()
    assert "__1_0.distcp is missing" in sharded.problem(d)
    (d / io.MARKER).write_text("{not json")
    assert "unreadable" in sharded.problem(d)
    assert not [p for p in d.iterdir() if p.name.endswith(".tmp")]


def test_latest_sharded_skips_incomplete(tmp_path, caplog):
    m = CheckpointManager(tmp_path)
    assert m.latest_sharded() is None
    for update in (2, 4, 10):
        _parts(m.sharded_path(update))
    io.mark_complete(m.sharded_path(2))
    io.mark_complete(m.sharded_path(4))
    assert m.latest_sharded() == m.sharded_path(4)  # numeric order: 10 is newest but has no marker
    assert "sharded_10" in caplog.text
    (m.sharded_path(4) / "__0_0.distcp").unlink()
    assert m.latest_sharded() == m.sharded_path(2)


def test_stale_temp_files_are_removed_by_the_first_save(tmp_path):
    m = CheckpointManager(tmp_path)
    m.dir.mkdir(parents=True)
    stale = [m.dir / ".model_7.ckpt.abc123.tmp", m.dir / ".last.ckpt.xyz.tmp"]
    for p in stale:
        p.write_bytes(b"half a checkpoint")
    keep = m.dir / "notes.txt"
    keep.write_text("mine")
    m.save({"model": {"w": torch.zeros(1)}}, update=1)
    assert not any(p.exists() for p in stale) and keep.exists()


# -- a rank failing mid-save, with FSDP on 2 gloo processes ---------------------------------------
def _save_two(env, manager: CheckpointManager):
    """Complete sharded checkpoints at updates 2 and 4; returns the model and the full params at 2."""
    torch.set_num_threads(1)
    strat, model, opt = build("mlp", "fsdp", env)
    train(strat, model, opt, "mlp", range(2), env.rank, env.world_size)
    save_sharded(str(manager.sharded_path(2)), strat, model, opt)
    at_2 = full_params(strat, model)
    train(strat, model, opt, "mlp", range(2, 4), env.rank, env.world_size)
    save_sharded(str(manager.sharded_path(4)), strat, model, opt)
    train(strat, model, opt, "mlp", range(4, 5), env.rank, env.world_size)
    return strat, model, opt, at_2


def _resume(env, manager: CheckpointManager) -> dict:
    """A fresh model: the torn directory is refused, the newest complete one loads."""
    strat, model, opt = build("mlp", "fsdp", env)
    try:
        load_sharded(str(manager.sharded_path(4)), strat, model, opt)
        refused = ""
    except UserError as e:
        refused = str(e)
    chosen = manager.latest_sharded()
    load_sharded(chosen, strat, model, opt)
    return {"refused": refused, "chosen": chosen.name, "params": full_params(strat, model)}


def _fail_then_resume(env, root: str) -> dict:
    """Rank 1's write fails while re-saving update 4's directory (DCP stops every rank), then resume."""
    import torch.distributed.checkpoint.filesystem as fs

    manager = CheckpointManager(root)
    strat, model, opt, at_2 = _save_two(env, manager)
    original = fs.FileSystemWriter.write_data
    if env.rank == 1:
        def fail(*args, **kwargs):
            raise OSError(28, "No space left on device")
        fs.FileSystemWriter.write_data = fail
    try:
        save_sharded(str(manager.sharded_path(4)), strat, model, opt)
        failed = False
    except BaseException:  # noqa: BLE001 - DCP raises its CheckpointException (a BaseException) on every rank
        failed = True
    fs.FileSystemWriter.write_data = original
    torn = manager.sharded_path(4)
    state = {"failed": failed, "metadata": (torn / ".metadata").exists(),
             "marker": (torn / io.MARKER).exists()}
    return {**state, **_resume(env, manager), "at_2": at_2}


def _check(result: dict) -> None:
    assert "sharded_4" in result["refused"] and "COMPLETE.json" in result["refused"]
    assert result["chosen"] == "sharded_2"
    for k, v in result["at_2"].items():
        assert torch.equal(result["params"][k], v), k


@pytest.mark.slow  # two gloo processes, one killed mid-save
def test_rank_fails_mid_save_directory_is_not_used(tmp_path):
    results = launch(_fail_then_resume, world_size=2, args=(str(tmp_path),), timeout=180)
    r = results[0]
    assert results[1]["failed"] and r["failed"]
    assert r["metadata"] and not r["marker"]  # the old .metadata is still there: DCP alone would load it
    _check(r)


def _save_then_die(env, root: str) -> None:
    import torch.distributed.checkpoint.filesystem as fs

    manager = CheckpointManager(root)
    strat, model, opt, at_2 = _save_two(env, manager)
    if env.rank == 0:
        torch.save(at_2, os.path.join(root, "at_2.pt"))
    if env.rank == 1:  # die like a node lost mid-save, before this rank's part is written
        fs.FileSystemWriter.write_data = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    save_sharded(str(manager.sharded_path(4)), strat, model, opt)  # rank 0 fails here too


def _resume_fresh(env, root: str) -> dict:
    torch.set_num_threads(1)
    return {**_resume(env, CheckpointManager(root)),
            "at_2": torch.load(os.path.join(root, "at_2.pt"), weights_only=True)}


@pytest.mark.slow
def test_rank_killed_mid_save_directory_is_not_used(tmp_path):
    with pytest.raises(LaunchError, match=r"ranks \[1\] died without a Python error"):
        launch(_save_then_die, world_size=2, args=(str(tmp_path),), timeout=120, pg_timeout_s=20)
    torn = tmp_path / "checkpoints" / "sharded_4"
    assert (torn / ".metadata").exists() and not (torn / io.MARKER).exists()
    _check(launch(_resume_fresh, world_size=2, args=(str(tmp_path),), timeout=120)[0])
