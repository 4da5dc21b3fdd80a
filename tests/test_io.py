"""mmvl.io: safe loading of torch files (missing, not torch, pickled payloads), atomic writes, umask."""
import os

import pytest
import torch

from mmvl import io
from mmvl.checkpoint import CheckpointManager
from mmvl.errors import UserError
from mmvl.io import atomic_save, safe_load

def _state(value: float, update: int = 0) -> dict:
    return {"model": {"w": torch.full((2, 3), value)}, "trainer": {"update": update, "best": None},
            "rng": {"torch": torch.get_rng_state()}, "config": {"a": [1, 2]}}

def test_missing_and_non_checkpoint_files(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        safe_load(tmp_path / "nope.ckpt")
    torch.save([torch.zeros(1)], tmp_path / "list.ckpt")
    with pytest.raises(UserError, match="list"):
        safe_load(tmp_path / "list.ckpt")
    torch.save({"w": torch.zeros(1)}, tmp_path / "bare.ckpt")
    with pytest.raises(UserError, match=r"lacks \['model'\]"):
        safe_load(tmp_path / "bare.ckpt")
    assert "w" in safe_load(tmp_path / "bare.ckpt", expect_keys=())

class _Payload:
    """Unpickling this would create a marker file (stands in for arbitrary code)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (_touch, (self.marker,))

def _touch(path):
    open(path, "w").close()
    return "ran"

def test_pickled_object_payload_is_refused_without_running(tmp_path):
    marker = tmp_path / "MARKER"
    path = tmp_path / "evil.ckpt"
    torch.save({"model": {"w": torch.zeros(1)}, "extra": _Payload(marker)}, path)
    assert not marker.exists()
    with pytest.raises(UserError, match=r"contains pickled Python objects.*weights-only") as err:
        safe_load(path)
    assert "evil.ckpt" in str(err.value) and "_touch" in str(err.value)
    assert not marker.exists()
    m = CheckpointManager(tmp_path / "run", max_to_keep=2)
    m.dir.mkdir(parents=True)
    os.replace(path, m.last_path)
    with pytest.raises(UserError, match="no loadable"):
        m.load_latest()
    assert not marker.exists()

@pytest.mark.parametrize("content, what", [
    (b"model: visual_bert\ntraining:\n  seed: 1\n", "a text file (it starts with 'model: visual_bert')"),
    (b'{"model": {"w": [1, 2]}}', "a text file"),
    (b"# notes\nnot a checkpoint\n", "a text file (it starts with '# notes')"),
    (b"", "an empty file"),
    (bytes(range(200, 240)), "a file of another format (it starts with bytes c8 c9"),
])
def test_a_file_that_is_no_torch_file_is_named(tmp_path, content, what):
    path = tmp_path / "model.ckpt"
    path.write_bytes(content)
    with pytest.raises(UserError) as info:
        safe_load(path)
    assert what in str(info.value) and "not a checkpoint written by torch.save" in str(info.value)
    assert "pickled" not in str(info.value) and "corrupt" not in str(info.value)

def test_atomic_save_creates_parent(tmp_path):
    p = atomic_save({"model": {}}, tmp_path / "a" / "b" / "x.ckpt")
    assert safe_load(p) == {"model": {}}

def test_written_files_follow_the_umask(tmp_path, umask):
    """The atomic writer, its temp folders and the sharded layout give what open()/mkdir would
    (mkstemp/mkdtemp make 0600/0700 whatever the umask)."""
    from mmvl.engine import save_sharded
    from mmvl.io import atomic_write, make_temp_dir
    from mmvl.config import save_config
    from mmvl.data.predictions import write_predictions
    from mmvl.distributed.env import DistEnv
    from mmvl.distributed.strategies.single import SingleStrategy
    from tests.fixtures.modes import tree, wrong_modes

    m = CheckpointManager(tmp_path / "run")
    m.save(_state(1.0, 2), update=2, is_best=True)
    save_config({"a": 1}, tmp_path / "run" / "config.yaml")
    write_predictions(str(tmp_path / "run"), "toy", "test", [{"id": 1, "answer": "yes"}])
    atomic_write(tmp_path / "run" / "notes.txt", "w", lambda f: f.write("x"))
    model = torch.nn.Linear(2, 2)
    save_sharded(m.sharded_path(4), SingleStrategy(None, DistEnv()), model,
                 torch.optim.AdamW(model.parameters()), extra={"trainer": {"update": 4}})
    make_temp_dir(tmp_path / "run")
    assert wrong_modes(tree(tmp_path / "run"), umask) == []


def test_a_published_folder_is_complete_and_a_second_publisher_uses_the_first(tmp_path):
    first = io.make_temp_dir(tmp_path)
    (first / "a.npy").write_bytes(b"12345")
    assert io.publish_dir(first, tmp_path / "entry", version=7)
    assert io.completeness_problem(tmp_path / "entry") is None
    assert io.read_marker(tmp_path / "entry") == {"version": 7, "files": {"a.npy": 5}}
    second = io.make_temp_dir(tmp_path)
    (second / "a.npy").write_bytes(b"12345")
    assert not io.publish_dir(second, tmp_path / "entry")  # another process was first: theirs is used
    assert not second.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["entry"]


def test_completeness_problems_name_the_part(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "part").write_bytes(b"1234")
    assert "no COMPLETE.json" in io.completeness_problem(d)
    io.mark_complete(d)
    (d / "part").write_bytes(b"12")
    assert io.completeness_problem(d) == "part part has 2 bytes, expected 4"
    (d / "part").unlink()
    assert io.completeness_problem(d) == "part part is missing"
    (d / io.MARKER).write_text("{torn")
    assert "unreadable" in io.completeness_problem(d)


def test_a_failed_publish_leaves_no_temp_folder(tmp_path, monkeypatch):
    tmp = io.make_temp_dir(tmp_path)
    (tmp / "x").write_text("x")
    (tmp_path / "entry").mkdir()
    (tmp_path / "entry" / "other").write_text("not ours, not complete")
    with pytest.raises(OSError):
        io.publish_dir(tmp, tmp_path / "entry")
    assert not tmp.exists() and (tmp_path / "entry" / "other").exists()


def test_move_aside_and_remove_tree(tmp_path):
    (tmp_path / "ckpts").mkdir()
    (tmp_path / "ckpts" / "last.ckpt").write_bytes(b"x")
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    target = io.move_aside([tmp_path / "ckpts", tmp_path / "metrics.jsonl"], tmp_path / "previous" / "1")
    assert sorted(p.name for p in target.iterdir()) == ["ckpts", "metrics.jsonl"]
    io.remove_tree(target)
    assert not target.exists() and list((tmp_path / "previous").iterdir()) == []


def test_only_io_renames_files():
    """``os.replace``/``os.rename`` belong to mmvl/io.py alone: every other writer goes through it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = []
    for folder, _, names in os.walk(os.path.join(root, "mmvl")):
        for name in names:
            path = os.path.join(folder, name)
            if name.endswith(".py") and path != os.path.join(root, "mmvl", "io.py"):
                text = open(path, encoding="utf-8").read()
                found += [path for call in ("os.replace(", "os.rename(") if call in text]
    assert found == []


def test_a_torn_last_line_is_cut(tmp_path):
    path = tmp_path / "events.jsonl"
    assert io.cut_torn_line(path) == 0  # no file
    path.write_bytes(b'{"a": 1}\n{"b": 2}\n')
    assert io.cut_torn_line(path) == 0 and path.read_bytes() == b'{"a": 1}\n{"b": 2}\n'
    path.write_bytes(b'{"a": 1}\n{"b": 2}\n{"c": ' + b"x" * 70000)  # longer than one read block
    assert io.cut_torn_line(path) == 70006
    assert path.read_bytes() == b'{"a": 1}\n{"b": 2}\n'
    path.write_bytes(b'{"only": "torn')
    assert io.cut_torn_line(path) == 14 and path.read_bytes() == b""


# -- no room: a full disk, a quota, the file-size limit --------------------------------------------
def _temps(folder):
    return [p.name for p in folder.iterdir() if io.TEMP.match(p.name)]


def test_no_room_is_seen_before_writing_and_the_old_file_stays(tmp_path, monkeypatch):
    from mmvl.utils import disk

    path = atomic_save(_state(1.0), tmp_path / "a.ckpt")
    before = path.read_bytes()
    monkeypatch.setattr(disk, "free_bytes", lambda folder: 10)
    with pytest.raises(io.DiskFull, match=r"a.ckpt': the disk is full \(~.* needed, 10 B free\); nothing written"):
        atomic_save(_state(2.0), path)
    monkeypatch.setattr(disk, "free_bytes", lambda folder: None)  # unknown: the write is tried
    monkeypatch.setattr(disk, "file_size_limit", lambda: 100)
    with pytest.raises(io.DiskFull, match=r"file-size limit \(ulimit -f: 100 B\) is below"):
        atomic_save(_state(2.0), path)
    assert path.read_bytes() == before and _temps(tmp_path) == []


@pytest.mark.parametrize("code, said", [(28, "the disk is full"), (122, "the disk quota is used up"),
                                        (27, "the file-size limit")])
def test_no_room_while_writing_names_the_file_and_removes_the_temp(tmp_path, code, said):
    path = tmp_path / "b.bin"
    io.atomic_write(path, "wb", lambda f: f.write(b"old"))

    def torch_like(f):  # torch.save reports the OSError only as the context of a RuntimeError
        try:
            raise OSError(code, os.strerror(code))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 768 vs 662")

    with pytest.raises(io.DiskFull, match=f"b.bin': {said}.*; temp file removed"):
        io.atomic_write(path, "wb", torch_like, needs=5000)
    assert path.read_bytes() == b"old" and _temps(tmp_path) == []
    with pytest.raises(OSError, match="Permission"):  # other errors keep their type
        io.atomic_write(path, "wb", lambda f: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))


@pytest.mark.parametrize("size", [1, 10_000])
def test_the_room_estimate_is_close_to_the_file(tmp_path, size):
    """Close both ways: above the truth it would refuse writes that fit."""
    from mmvl.utils import disk

    state = {**_state(1.0), "optimizer": {"state": {i: {"m": torch.zeros(size + i)} for i in range(20)}},
             "config": {"name": "x" * 300, "lr": 0.1, "layers": list(range(50))}}
    written = atomic_save(state, tmp_path / "c.ckpt").stat().st_size
    assert abs(disk.estimate_bytes(state) - written) < 0.2 * written
