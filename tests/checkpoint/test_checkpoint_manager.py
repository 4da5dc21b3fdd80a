"""The checkpoint manager: round trip, crash safety, pruning, corrupt files, resume choice, sharded folders."""
import logging
import os

import pytest
import torch

from mmvl import io
from mmvl.checkpoint import CheckpointManager, sharded
from mmvl.errors import UserError
from mmvl.io import safe_load

def _state(value: float, update: int = 0) -> dict:
    return {"model": {"w": torch.full((2, 3), value)}, "trainer": {"update": update, "best": None},
            "rng": {"torch": torch.get_rng_state()}, "config": {"a": [1, 2]}}

def test_round_trip_and_links(tmp_path):
    m = CheckpointManager(tmp_path, max_to_keep=3)
    written = m.save(_state(1.0, 10), update=10, is_best=True)
    assert written == m.dir / "model_10.ckpt"
    m.save(_state(2.0, 20), update=20)
    last = safe_load(m.last_path)
    assert last["trainer"]["update"] == 20 and torch.equal(last["model"]["w"], torch.full((2, 3), 2.0))
    assert last["config"] == {"a": [1, 2]}
    assert safe_load(m.best_path)["trainer"]["update"] == 10
    loaded, path = m.load_latest()
    assert path == m.last_path and loaded["trainer"]["update"] == 20
    # non-periodic save only replaces last.ckpt; best keeps its own file
    m.save(_state(3.0, 25), update=25, periodic=False)
    assert safe_load(m.last_path)["trainer"]["update"] == 25
    assert [p.name for p in m.periodic_paths()] == ["model_10.ckpt", "model_20.ckpt"]
    assert safe_load(m.best_path)["trainer"]["update"] == 10
    assert not [p for p in m.dir.iterdir() if p.name.endswith(".tmp")]

def test_state_is_serialised_once_per_save(tmp_path, monkeypatch):
    calls = []
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: (calls.append(1), real_save(obj, f, *a, **k)))
    m = CheckpointManager(tmp_path, max_to_keep=2)
    m.save(_state(1.0, 1), update=1, is_best=True)
    assert len(calls) == 1
    assert safe_load(m.best_path)["trainer"]["update"] == safe_load(m.last_path)["trainer"]["update"] == 1

def test_pruning_keeps_newest_n_and_links_survive(tmp_path):
    m = CheckpointManager(tmp_path, max_to_keep=2)
    for u in (100, 200, 300, 1000):
        m.save(_state(float(u), u), update=u, is_best=(u == 100))
    assert [p.name for p in m.periodic_paths()] == ["model_300.ckpt", "model_1000.ckpt"]  # numeric order
    assert safe_load(m.best_path)["trainer"]["update"] == 100  # pruned periodic file, best still valid
    keep_all = CheckpointManager(tmp_path / "all", max_to_keep=0)
    for u in range(4):
        keep_all.save(_state(0.0, u), update=u)
    assert len(keep_all.periodic_paths()) == 4

def test_crash_mid_save_keeps_previous_last(tmp_path, monkeypatch):
    m = CheckpointManager(tmp_path, max_to_keep=5)
    m.save(_state(1.0, 1), update=1)
    real_save = torch.save

    def partial_then_crash(obj, f, *a, **k):
        f.write(b"PK\x03\x04 half a zip")  # what a dying process leaves behind
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", partial_then_crash)
    with pytest.raises(OSError):
        m.save(_state(2.0, 2), update=2)
    with pytest.raises(OSError):  # a non-periodic save writes last.ckpt itself
        m.save(_state(2.0, 2), update=2, periodic=False)
    monkeypatch.setattr(torch, "save", real_save)
    assert safe_load(m.last_path)["trainer"]["update"] == 1
    assert not (m.dir / "model_2.ckpt").exists()

    def replace_crash(src, dst):
        raise OSError("killed before rename")

    monkeypatch.setattr(io.os, "replace", replace_crash)
    with pytest.raises(OSError):
        m.save(_state(3.0, 3), update=3)
    monkeypatch.undo()
    assert safe_load(m.last_path)["trainer"]["update"] == 1
    assert sorted(p.name for p in m.dir.iterdir()) == ["last.ckpt", "model_1.ckpt"]  # no temp files left

def test_truncated_file_is_user_error_and_load_latest_falls_back(tmp_path, caplog):
    m = CheckpointManager(tmp_path, max_to_keep=5)
    m.save(_state(1.0, 1), update=1)
    m.save(_state(2.0, 2), update=2)
    # corrupt the newest: last.ckpt (a link to model_2) truncated in place
    data = (m.dir / "model_2.ckpt").read_bytes()
    for p in (m.last_path, m.dir / "model_2.ckpt"):
        p.unlink()
        p.write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match=r"last\.ckpt.*truncated or corrupt"):
        safe_load(m.last_path)
    with caplog.at_level(logging.WARNING):
        loaded, path = m.load_latest()
    assert path.name == "model_1.ckpt" and loaded["trainer"]["update"] == 1
    assert "last.ckpt" in caplog.text and "model_2.ckpt" in caplog.text
    (m.dir / "model_1.ckpt").write_bytes(b"")
    with pytest.raises(UserError, match="no loadable checkpoint"):
        m.load_latest()

def test_choose_resume(tmp_path, caplog):
    m = CheckpointManager(tmp_path, max_to_keep=2)
    assert m.choose_resume("auto") is None and m.choose_resume(False) is None
    with pytest.raises(UserError, match="checkpoint.resume=true but there is no checkpoint"):
        m.choose_resume(True)
    assert m.choose_resume(True, pretrained=True) is None  # the pretrained weights are the start
    m.save(_state(1.0, 1), update=1)
    with caplog.at_level(logging.WARNING):
        assert m.choose_resume("auto", resume_best=True) == m.last_path
    assert "resume_best" in caplog.text
    m.save(_state(1.0, 2), update=2, is_best=True)
    assert m.choose_resume("auto", resume_best=True) == m.best_path
    assert m.choose_resume(False) is None
    other = tmp_path / "other.ckpt"
    assert m.choose_resume(False, resume_file=str(other)) == other  # an explicit file wins
    # ... unless it only holds pretrained weights: then the run's own checkpoints continue it
    assert m.choose_resume("auto", resume_file=str(other), pretrained=True) == m.last_path
    assert m.choose_resume(False, resume_file=str(other), pretrained=True) is None
    m.last_path.unlink()
    assert m.choose_resume(True) == m.dir / "model_2.ckpt"

def test_move_aside_keeps_everything(tmp_path):
    m = CheckpointManager(tmp_path)
    assert m.move_aside() is None  # nothing to move
    m.save(_state(1.0, 3), update=3)
    (tmp_path / "metrics.jsonl").write_text('{"update": 3}\n')
    first = m.move_aside()
    assert first.parent == tmp_path / "previous"
    assert sorted(os.listdir(first / "checkpoints")) == ["last.ckpt", "model_3.ckpt"]
    assert (first / "metrics.jsonl").read_text() == '{"update": 3}\n'
    assert not m.dir.exists() and not (tmp_path / "metrics.jsonl").exists()
    m.save(_state(2.0, 1), update=1)
    second = m.move_aside()  # the same second: a second folder, never an overwrite
    assert second != first and safe_load(second / "checkpoints" / "last.ckpt")["trainer"]["update"] == 1
    assert safe_load(first / "checkpoints" / "last.ckpt")["trainer"]["update"] == 3

def test_load_latest_best_and_empty(tmp_path, caplog):
    m = CheckpointManager(tmp_path, max_to_keep=3)
    assert m.load_latest() is None and m.directory == tmp_path / "checkpoints"
    m.save(_state(1.0, 1), update=1)
    with caplog.at_level(logging.WARNING):
        assert m.load_latest(best=True)[1] == m.last_path  # no best yet: warn, use last
    assert "resume_best" in caplog.text
    m.save(_state(2.0, 2), update=2, is_best=True)
    m.save(_state(3.0, 3), update=3)
    state, path = m.load_latest(best=True)
    assert path == m.best_path and state["trainer"]["update"] == 2
    m.best_path.unlink()
    m.best_path.write_bytes(b"garbage")
    state, path = m.load_latest(best=True)  # corrupt best falls back to last
    assert path == m.last_path and state["trainer"]["update"] == 3

def _sharded(m: CheckpointManager, update: int, complete: bool = True, with_state: bool = True):
    """A fabricated trainer sharded checkpoint (DCP parts are opaque bytes here)."""
    from mmvl.checkpoint.schema import SHARDED_STATE

    d = m.sharded_path(update)
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(b"x" * 8)
    (d / ".metadata").write_bytes(b"m")
    if with_state:
        io.atomic_save({"trainer": {"update": update}}, d / SHARDED_STATE)
    if complete:
        io.mark_complete(d, world_size=2)
    return d

def test_find_latest_picks_newest_of_full_and_sharded(tmp_path, caplog):
    m = CheckpointManager(tmp_path, max_to_keep=3)
    assert m.find_latest() is None
    m.save(_state(1.0, 10), update=10, periodic=False)  # last.ckpt at 10
    assert m.find_latest() == m.last_path
    s20 = _sharded(m, 20)
    _sharded(m, 30, complete=False)  # a crash mid-save: skipped with a warning
    _sharded(m, 40, with_state=False)  # a strategy-level save: not resumable by the trainer
    with caplog.at_level(logging.WARNING):
        assert m.find_latest() == s20
    assert "sharded_30" in caplog.text and "no COMPLETE.json" in caplog.text and "sharded_40" in caplog.text
    with pytest.raises(UserError, match="sharded_20.*is sharded.*distributed.strategy=fsdp"):
        m.find_latest(sharded=False)  # the newest is sharded but cannot be read: never fall back silently
    m.save(_state(2.0, 20), update=20, periodic=False, is_best=True)  # a tie: sharded wins if readable
    assert m.find_latest() == s20 and m.find_latest(sharded=False) == m.last_path
    assert m.find_latest(best=True) == m.best_path
    m.save(_state(3.0, 25), update=25)  # model_25.ckpt + last
    assert m.find_latest() == m.last_path
    m.last_path.unlink()
    m.last_path.write_bytes(b"torn")  # unreadable last: the newest periodic file vs sharded_20
    assert m.find_latest() == m.dir / "model_25.ckpt"
    (m.dir / "model_25.ckpt").write_bytes(b"torn")
    assert m.find_latest() == s20  # unreadable full files do not hide a good sharded checkpoint
    legacy = tmp_path / "legacy.ckpt"  # the old (non-zip) format cannot be mapped: read it whole
    torch.save(_state(4.0, 4), legacy, _use_new_zipfile_serialization=False)
    assert safe_load(legacy, mmap=True)["trainer"]["update"] == 4

def test_prune_sharded_keeps_newest_complete(tmp_path):

    m = CheckpointManager(tmp_path, max_to_keep=2)
    for u in (5, 10, 20, 100):
        _sharded(m, u)
    _sharded(m, 15, complete=False)
    m.save_best(_state(1.0, 5))
    removed = m.prune_sharded()
    assert sorted(p.name for p in removed) == ["sharded_10", "sharded_15", "sharded_5"]
    assert [p.name for p in m.sharded_paths()] == ["sharded_20", "sharded_100"]  # numeric order
    assert all(sharded.problem(p) is None for p in m.sharded_paths())
    assert safe_load(m.best_path)["trainer"]["update"] == 5
    assert CheckpointManager(tmp_path, max_to_keep=0).prune_sharded() == []

def test_agreement_helpers_in_one_process():
    from mmvl.distributed.comm import all_ranks_agreed, on_main_agreed

    assert on_main_agreed(lambda: 3, "x") == 3
    with pytest.raises(UserError, match="^bad$"):
        on_main_agreed(lambda: (_ for _ in ()).throw(UserError("bad")), "x")
    all_ranks_agreed(None, "x")
    with pytest.raises(UserError, match="^missing$"):
        all_ranks_agreed("missing", "x")

def test_zero_optimizers_cannot_read_sharded(tmp_path):
    from mmvl.distributed.env import DistEnv
    from mmvl.distributed.strategies.base import Strategy

    class OwnFormat(torch.optim.SGD):  # e.g. ZeroRedundancyOptimizer, fairscale OSS
        def state_dict(self):
            return {}

    model = torch.nn.Linear(2, 2)
    strategy = Strategy(None, DistEnv())
    assert strategy.can_load_sharded(torch.optim.AdamW(model.parameters()))
    assert not strategy.can_load_sharded(OwnFormat(model.parameters(), lr=0.1))
    with pytest.raises(UserError, match="is sharded.*cannot load it; resume it with .*fsdp"):
        strategy.load_sharded_state(model, OwnFormat(model.parameters(), lr=0.1), str(tmp_path))
