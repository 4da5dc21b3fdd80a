"""A corpus of bad input for ``mmvl_run``: each gives exit code 2, one line on stderr naming the bad
key or file, no traceback, and leaves an existing run's save_dir as it was (checkpoints,
metrics, config.yaml byte for byte; train.log only appended to).

Most rows run in-process through ``mmvl_cli.run.main`` (fast); a few run as real processes
(started together), including a 2-process launch for a batch size the world size does not divide.
"""
from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

from mmvl.locks import LOCK
from mmvl_cli.predict import main as predict_main
from mmvl_cli.run import main
from tests.fixtures.faults import ROOT, child_env, launch_ranks
from tests.fixtures.toy import register, toy_opts

register()


# -- fixtures: a finished run to protect, and a folder of bad files ------------------------------
@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("bad_inputs")
    assert main(toy_opts(base / "previous", "run_type=train", "training.max_updates=4",
                         "training.checkpoint_interval=2")) == 0
    files = base / "files"
    files.mkdir()
    (files / "a.yaml").write_text("includes: [b.yaml]\ntraining: {seed: 2}\n")
    (files / "b.yaml").write_text("includes: [a.yaml]\n")
    (files / "syntax.yaml").write_text("training:\n  seed: [1, 2\n")
    (files / "list.yaml").write_text("- model\n- toy_mlp\n")
    (files / "binary.yaml").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))  # a picture saved as .yaml
    (files / "eval.yaml").write_text("training:\n  seed: ${eval:__import__('os').getpid()}\n")
    (files / "resolver.yaml").write_text('training:\n  seed: ${eval:"1 + 1"}\n')
    (files / "notes.ckpt").write_text("not a checkpoint\n")
    torch.save(torch.zeros(3), files / "tensor.ckpt")
    data = (base / "previous" / "save" / "checkpoints" / "last.ckpt").read_bytes()
    (files / "truncated.ckpt").write_bytes(data[: len(data) // 2])
    (files / "a_file").write_text("x")
    return base


@dataclass
class Ctx:
    root: Path  # this row's folder; its save/ starts as a copy of the finished run
    world: Path

    @property
    def save(self) -> Path:
        return self.root / "save"

    @property
    def files(self) -> Path:
        return self.world / "files"


@dataclass
class Row:
    id: str
    extra: Callable[[Ctx], list[str]]
    needle: Callable[[Ctx], str] | str
    prepare: Callable[[Ctx], None] | None = None
    fresh: bool = False  # start from an empty save_dir instead of a finished run
    vl: str | None = None  # run on this vision-and-language dataset (tiny concat_bert) instead of toy
    predict: bool = False  # mmvl_predict instead of mmvl_run
    slow: bool = False  # with the slow tests (the fast suite is near its budget)
    proc: bool = False  # starts processes (DataLoader workers): in the proc tier


def _corrupt_all(ctx: Ctx) -> None:
    for p in (ctx.save / "checkpoints").glob("*.ckpt"):
        p.write_bytes(p.read_bytes()[:100])


ROWS = [
    # config: keys, values, types, files
    Row("unknown key", lambda c: ["training.batchsize=4"], "training.batch_size"),
    Row("unknown top-level key", lambda c: ["trainig.seed=3"], "trainig"),
    Row("misspelled value", lambda c: ["run_type=trian"], "run_type"),
    Row("wrong type int", lambda c: ["training.max_updates=abc"], "training.max_updates"),
    Row("wrong type list", lambda c: ["training.batch_size=[1,2]"], "training.batch_size"),
    Row("wrong type float for int", lambda c: ["training.seed=1.5"], "training.seed"),
    Row("gradient accumulation 0", lambda c: ["training.gradient_accumulation=0"], "training.gradient_accumulation"),
    Row("bad precision", lambda c: ["training.precision=fp8"], "training.precision"),
    Row("bad strategy", lambda c: ["distributed.strategy=ddpp"], "distributed.strategy"),
    Row("bad device", lambda c: ["training.device=tpu"], "training.device='tpu'"),
    Row("not key=value", lambda c: ["oops"], "'oops'"),
    Row("includes cycle", lambda c: [f"config={c.files / 'a.yaml'}"], "include cycle"),
    Row("missing config file", lambda c: [f"config={c.files / 'nope.yaml'}"], "nope.yaml"),
    Row("yaml syntax error", lambda c: [f"config={c.files / 'syntax.yaml'}"], "syntax.yaml line 3"),
    Row("yaml not a mapping", lambda c: [f"config={c.files / 'list.yaml'}"], "list.yaml"),
    Row("config is a binary file", lambda c: [f"config={c.files / 'binary.yaml'}"],
        "binary.yaml' is not a text file (byte 0x89 at offset 0 is not UTF-8); expected a UTF-8 YAML file"),
    Row("an expression in a config file", lambda c: [f"config={c.files / 'eval.yaml'}"],
        "key 'training.seed': not a valid ${...} interpolation (token recognition error at: '('); expected ${a.key}"),
    Row("an expression on the command line", lambda c: ["training.seed=${eval:len('ab')}"],
        "not a valid ${...} interpolation (token recognition error at: '('); expected ${a.key}"),
    Row("an unknown resolver", lambda c: [f"config={c.files / 'resolver.yaml'}"],
        "'${eval:...}' is not a resolver (known: env, device_count"),
    Row("user_dir missing", lambda c: [f"env.user_dir={c.root / 'no_such_dir'}"], "env.user_dir"),
    # registry names
    Row("unknown model", lambda c: ["model=toy_mlpp"], "'toy_mlpp'. Did you mean 'toy_mlp'"),
    Row("unknown dataset", lambda c: ["datasets=toyy"], "'toyy'. Did you mean 'toy'"),
    Row("unknown optimizer", lambda c: ["optimizer.type=adamm"], "optimizer 'adamm'"),
    Row("unknown scheduler", lambda c: ["scheduler.type=warmup_cosin"], "scheduler 'warmup_cosin'"),
    Row("unknown metric", lambda c: ["evaluation.metrics=[accuracyy]"], "metric 'accuracyy'"),
    Row("unknown loss", lambda c: ["model_config.toy_mlp.losses=[{type: cross_entropyy}]"], "loss 'cross_entropyy'"),
    Row("unknown callback", lambda c: ["training.callbacks=[{type: stop_att}]"], "callback 'stop_att'"),
    Row("bad optimizer value", lambda c: ["optimizer.params.lr=-1"], "optimizer.params.lr"),
    Row("infinite learning rate", lambda c: ["optimizer.params.lr=inf"], "optimizer.params.lr=inf (command line) is not a finite"),
    Row("negative checkpoint interval", lambda c: ["training.checkpoint_interval=-10"],
        "'training.checkpoint_interval' in command line must be an integer, 0 or more (0 turns it off)"),
    Row("empty save_dir", lambda c: ["env.save_dir="], "'env.save_dir' in command line is empty"),
    Row("world size 0", lambda c: ["distributed.world_size=0"], "'distributed.world_size' in command line must be an integer, 1 or more"),
    Row("negative num_workers", lambda c: ["training.num_workers=-1"], "'training.num_workers' in command line must be an integer, 0 or more"),
    # the run: data size, save_dir, checkpoints
    Row("dataset smaller than a batch", lambda c: ["training.batch_size=1000"], "training.batch_size"),
    Row("save_dir under a file", lambda c: [f"env.save_dir={c.files / 'a_file' / 'sub'}"], "env.save_dir"),
    Row("resume=true without checkpoint", lambda c: ["checkpoint.resume=true"], "checkpoint.resume=true",
        fresh=True),
    Row("resume_file missing", lambda c: [f"checkpoint.resume_file={c.files / 'gone.ckpt'}"], "gone.ckpt"),
    Row("resume_file not a checkpoint", lambda c: [f"checkpoint.resume_file={c.files / 'notes.ckpt'}"],
        "notes.ckpt"),
    Row("resume_file holds a tensor", lambda c: [f"checkpoint.resume_file={c.files / 'tensor.ckpt'}"],
        "tensor.ckpt' is not an mmvl checkpoint"),
    Row("resume_file truncated", lambda c: [f"checkpoint.resume_file={c.files / 'truncated.ckpt'}"],
        "truncated.ckpt' is truncated or corrupt"),
    Row("checkpoint of another model", lambda c: ["model_config.toy_mlp.hidden_size=32"],
        "model_config.toy_mlp.hidden_size (16 -> 32)"),  # resume=auto compares the configs first
    Row("checkpoint of another model, evaluated", lambda c: ["run_type=val", "model_config.toy_mlp.hidden_size=32"],
        "trained with other model settings, model_config.toy_mlp.hidden_size (16 -> 32) (key 'net.0.weight': "
        "checkpoint (16, 8) vs model (32, 8))"),
    Row("checkpoint trained on another dataset, evaluated", lambda c: ["run_type=val", "model_config.toy_mlp.hidden_size=32"],
        "holds toy_mlp trained on sort_of_clevr, sized for that data, and this run is on toy (key 'net.0.weight'",
        prepare=lambda c: _forge_config(c, datasets=["sort_of_clevr"])),
    Row("checkpoint of another model by its config, evaluated",
        lambda c: ["run_type=val", "model_config.toy_mlp.hidden_size=32"],
        "holds a relation_network model and this run builds toy_mlp (key 'net.0.weight'", slow=True,
        prepare=lambda c: _forge_config(c, model="relation_network")),
    Row("resume into another model", lambda c: [],
        "last.ckpt is from another config: model ('relation_network' -> 'toy_mlp'), training.batch_size (3 -> 8) "
        "and 1 more (all in train.log)",  # toy_mlp's keys, unset there, are at its YAML's defaults
        prepare=lambda c: _forge_config(c, model="relation_network", model_config={"relation_network": {}},
                                        training={"seed": 9, "batch_size": 3, "max_updates": 100})),
    Row("every checkpoint corrupt", lambda c: [], "no loadable checkpoint", prepare=_corrupt_all),
    Row("predictions is a file", lambda c: [], "predictions' is a file, and the predictions go into a folder",
        predict=True, prepare=lambda c: (c.save / "predictions").write_text("my notes\n")),
    Row("predictions is a file, mmvl_run predicting", lambda c: ["evaluation.predict=true", "training.max_updates=18"],
        "predictions' is a file, and the predictions go into a folder",
        prepare=lambda c: (c.save / "predictions").write_text("my notes\n")),  # refused before training on
    Row("a prediction file is a folder", lambda c: [], "toy_test.json' is a folder", predict=True,
        prepare=lambda c: (c.save / "predictions" / "toy_test.json").mkdir(parents=True)),
    Row("the user's config.yaml in save_dir", lambda c: [f"config={c.save / 'config.yaml'}"],
        lambda c: f"'{c.save / 'config.yaml'}' is not a config mmvl wrote",
        prepare=lambda c: (c.save / "config.yaml").write_text("training:\n  seed: 1\n")),
    # data files (vision-and-language datasets; skipped where their builders are absent)
    Row("vqa2 questions missing", lambda c: [], "v2_OpenEnded_mscoco_train2014_questions.json", vl="vqa2",
        prepare=lambda c: (c.root / "data/vqa2/v2_OpenEnded_mscoco_train2014_questions.json").unlink()),
    Row("vqa2 annotations truncated", lambda c: [], "v2_mscoco_train2014_annotations.json' is not valid JSON",
        vl="vqa2", prepare=lambda c: _truncate(c.root / "data/vqa2/v2_mscoco_train2014_annotations.json")),
    Row("hateful_memes jsonl line invalid", lambda c: [], "train.jsonl' line 3 is not valid JSON",
        vl="hateful_memes", prepare=lambda c: _break_line(c.root / "data/hateful_memes/train.jsonl", 2)),
    Row("hateful_memes jsonl truncated", lambda c: [], lambda c: f"train.jsonl' line {_lines(c)} is not valid JSON",
        vl="hateful_memes", prepare=lambda c: _truncate(c.root / "data/hateful_memes/train.jsonl")),
    Row("image does not decode", lambda c: [], "cannot be decoded", vl="hateful_memes", fresh=True,
        prepare=lambda c: _break_images(c.root / "data/hateful_memes/img", range(1000, 1008))),
    Row("image does not decode in a DataLoader worker", lambda c: ["training.num_workers=1"],
        ".png' cannot be decoded", vl="hateful_memes", fresh=True, proc=True,
        prepare=lambda c: _break_images(c.root / "data/hateful_memes/img", range(1000, 1008))),
    Row("sort_of_clevr questions truncated", lambda c: _SOC, "train_questions.json has",
        vl="sort_of_clevr", fresh=True, slow=True, prepare=lambda c: _truncate(_soc(c) / "train_questions.json")),
    Row("sort_of_clevr questions corrupt, same size", lambda c: _SOC,
        "train_questions.json' does not read (JSONDecodeError", vl="sort_of_clevr", fresh=True, slow=True,
        prepare=lambda c: _scramble(_soc(c) / "train_questions.json")),
    Row("sort_of_clevr images corrupt, same size", lambda c: _SOC, "train.npz' does not read (BadZipFile",
        vl="sort_of_clevr", fresh=True, slow=True, prepare=lambda c: _scramble(_soc(c) / "train.npz")),
    Row("feature LMDB missing", lambda c: _features("feats/none.lmdb"), "feats/none.lmdb", vl="hateful_memes"),
    Row("feature LMDB corrupt", lambda c: _features("feats/bad.lmdb"), "bad.lmdb is not a readable LMDB",
        vl="hateful_memes", fresh=True, prepare=lambda c: _bad_lmdb(c.root / "data/feats/bad.lmdb")),
]


#: a tiny generated Sort-of-CLEVR
_SOC = [f"dataset_config.sort_of_clevr.{k}={v}" for k, v in {
    "num_images": 4, "num_val_images": 2, "num_test_images": 2, "questions_per_image": 2, "object_size": 1}.items()]


def _soc(ctx: Ctx) -> Path:
    """Generate the rows' Sort-of-CLEVR (as mmvl_run would) and return its folder."""
    from mmvl.config import load_config
    from mmvl.registry import DATASETS

    config = load_config(vl_opts("sort_of_clevr", ctx.root, *_SOC))
    builder = DATASETS.get("sort_of_clevr")(config.dataset_config.sort_of_clevr, str(ctx.root / "data"))
    builder.prepare()
    return builder.root


def _scramble(path: Path) -> None:
    """Overwrite the last quarter of ``path`` with other bytes of the same length (its size stays)."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 3 // 4] + b"#" * (len(data) - len(data) * 3 // 4))


def _forge_config(ctx: Ctx, **saved) -> None:
    """Make every checkpoint say (in its own config) it was trained with ``saved`` merged in."""
    for path in (ctx.save / "checkpoints").glob("*.ckpt"):
        state = torch.load(path, weights_only=True)
        for key, value in saved.items():
            merged = state["config"].get(key)
            state["config"][key] = {**merged, **value} if isinstance(value, dict) and key != "model_config" else value
        torch.save(state, path)


def _truncate(path: Path) -> None:
    """Cut ``path`` in the middle of a line, the way an interrupted download ends."""
    text = path.read_text()
    cut = text.find("\n", len(text) // 2)
    path.write_text(text[: (cut if cut > 0 else len(text) // 2) - 5])


def _lines(ctx: Ctx) -> int:
    return (ctx.root / "data/hateful_memes/train.jsonl").read_text().count("\n") + 1


def _break_line(path: Path, index: int) -> None:
    lines = path.read_text().splitlines()
    lines[index] = lines[index][:20]
    path.write_text("\n".join(lines) + "\n")


def _break_images(folder: Path, ids) -> None:
    for i in ids:
        (folder / f"{i:05d}.png").write_bytes(b"not a png")


def _bad_lmdb(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "data.mdb").write_bytes(bytes(range(256)) * 40)


def _features(path: str) -> list[str]:
    return [f"dataset_config.hateful_memes.processors.features={{type: features, params: "
            f"{{path: {path}, max_features: 4}}}}", "model_config.concat_bert.feature_dim=6"]


def vl_opts(dataset: str, root: Path, *extra: str) -> list[str]:
    """A 2-update run of a tiny concat_bert on ``<root>/data/<dataset>``."""
    m = "model_config.concat_bert"
    return ["model=concat_bert", f"datasets={dataset}", f"env.data_dir={root / 'data'}",
            f"env.save_dir={root / 'save'}", "training.max_updates=2", "training.batch_size=2",
            "training.num_workers=0", "training.progress_bar=false", "scheduler.params.num_warmup_steps=1",
            f"dataset_config.{dataset}.image_size=16", f"{m}.hidden_size=16", f"{m}.num_hidden_layers=1",
            f"{m}.num_attention_heads=2", f"{m}.intermediate_size=16",
            f"{m}.image_encoder.params={{channels: [4, 8], strides: [4, 4]}}", *extra]


# -- checks ------------------------------------------------------------------------------------
def snapshot(save: Path) -> dict[str, str]:
    if not save.exists():
        return {}
    return {str(p.relative_to(save)): (p.read_text() if p.name == "train.log"
                                       else hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(save.rglob("*")) if p.is_file() and p.name != LOCK}  # the lock names its holder


def assert_unchanged(before: dict[str, str], save: Path) -> None:
    after = snapshot(save)
    log_before, log_after = before.pop("train.log", ""), after.pop("train.log", "")
    assert log_after.startswith(log_before), "train.log was rewritten, not appended to"
    assert after == before, "the save_dir was changed"


def assert_one_line(err: str, needle: str, prefix: str = "mmvl: error: ", roots: tuple[Path, ...] = ()) -> None:
    """One line with ``needle``, under 300 characters once the test's own folders (``roots``, long
    pytest names) are written as ``/run``."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(prefix), err
    assert needle in lines[0], f"{needle!r} not in: {lines[0]}"
    short = lines[0]
    for root in roots:
        short = short.replace(str(root), "/run")
    assert len(short) < 300, f"{len(short)} characters: {short}"
    assert "Traceback" not in err


def setup_row(row: Row, world: Path, root: Path) -> Ctx:
    ctx = Ctx(root, world)
    if not row.fresh:
        shutil.copytree(world / "previous" / "save", ctx.save)
    if row.vl:
        from tests.fixtures import vl_data

        write = getattr(vl_data, f"write_{row.vl}", None)  # generated datasets need no files
        if write is not None:
            write(root / "data")
    if row.prepare:
        row.prepare(ctx)
    return ctx


def _marks(row: Row) -> list:
    """slow rows run with the slow tests; a row that uses DataLoader workers starts processes."""
    return ([pytest.mark.slow] if row.slow else []) + ([pytest.mark.proc] if row.proc else [])


@pytest.mark.parametrize("row", [pytest.param(r, marks=_marks(r)) for r in ROWS], ids=[r.id for r in ROWS])
def test_bad_input_in_process(row, world, tmp_path, capsys):
    ctx = setup_row(row, world, tmp_path)
    before = snapshot(ctx.save)
    opts = vl_opts(row.vl, tmp_path, *row.extra(ctx)) if row.vl else toy_opts(tmp_path, *row.extra(ctx))
    code = (predict_main if row.predict else main)(opts)
    err = capsys.readouterr().err
    assert code == 2, err
    assert_one_line(err, row.needle(ctx) if callable(row.needle) else row.needle, roots=(tmp_path, world))
    if row.fresh:  # the error comes with the first batch: nothing to protect, nothing saved
        assert not (ctx.save / "checkpoints").exists()
    else:
        assert_unchanged(before, ctx.save)


def test_row_count():
    assert len(ROWS) >= 20


# -- real processes, started together -------------------------------------------------------------
PROCESS_ROWS = {
    "yaml syntax error": (["-m", "mmvl_cli.run", "config={files}/syntax.yaml"], "syntax.yaml line 3"),
    "truncated checkpoint": (["-m", "mmvl_cli.run", "env.user_dir=tests/fixtures",
                              "checkpoint.resume_file={files}/truncated.ckpt"], "truncated.ckpt"),
}


@pytest.fixture(scope="module")
def processes(world, tmp_path_factory):
    """Every PROCESS_ROWS command and a 2-rank batch-size mismatch, all running at once."""
    started, out = {}, {}
    for name, (args, needle) in PROCESS_ROWS.items():
        root = tmp_path_factory.mktemp("proc")
        shutil.copytree(world / "previous" / "save", root / "save")
        args = [a.format(files=world / "files", root=root) for a in args]
        if "truncated" in name:
            args = args[:2] + toy_opts(root) + args[2:]
        out[name] = (root, snapshot(root / "save"), needle)
        started[name] = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=child_env(),
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ranks_root = tmp_path_factory.mktemp("ranks")
    ranks = launch_ranks(toy_opts(ranks_root, "training.batch_size=7", "training.device=cpu"), 2, timeout=120)
    results = {name: (*p.communicate(timeout=120), p.returncode) for name, p in started.items()}
    return out, results, ranks


@pytest.mark.proc
@pytest.mark.parametrize("name", list(PROCESS_ROWS))
def test_bad_input_real_process(processes, name):
    out, results, _ = processes
    root, before, needle = out[name]
    stdout, stderr, code = results[name]
    assert code == 2, stderr
    assert_one_line(stderr, needle)
    if before:
        assert_unchanged(before, root / "save")


@pytest.mark.proc
def test_batch_not_divisible_by_world_size(processes):
    """2 real ranks, global batch 7: every rank exits 2 with one line naming the setting."""
    *_, ranks = processes
    for rank, r in enumerate(ranks):
        assert r.returncode == 2, r.stderr
        prefix = "mmvl: error: " if rank == 0 else "mmvl: error (rank 1): "
        assert_one_line(r.stderr, "training.batch_size=7 is not divisible by the world size 2", prefix)


# -- faults: the run stops with one line, the last good checkpoint loads, a resume goes on -------
FAULTS = {  # what the disk reports -> what the line must say
    "disk full": (("free_bytes", lambda folder: 0), "the disk is full"),
    "file-size limit": (("file_size_limit", lambda: 64), "the file-size limit (ulimit -f: 64 B)"),
}


@pytest.mark.parametrize("fault", list(FAULTS), ids=list(FAULTS))
def test_no_room_for_a_checkpoint(fault, world, tmp_path, capsys, monkeypatch):
    from mmvl.checkpoint import load_checkpoint
    from mmvl.checkpoint.schema import update_of
    from mmvl.utils import disk

    (name, fake), needle = FAULTS[fault]
    shutil.copytree(world / "previous" / "save", tmp_path / "save")
    last = tmp_path / "save" / "checkpoints" / "last.ckpt"
    saved = update_of(load_checkpoint(last))
    more = toy_opts(tmp_path, f"training.max_updates={saved + 2}", "training.checkpoint_interval=2")
    with monkeypatch.context() as patch:
        patch.setattr(disk, name, fake)
        code = main(more)
    err = capsys.readouterr().err
    assert code == 2, err
    assert_one_line(err, needle, roots=(tmp_path,))
    assert f"last.ckpt (update {saved}) is intact" in err and "(nothing written)" in err, err
    assert update_of(load_checkpoint(last)) == saved
    assert not [p for p in last.parent.iterdir() if p.name.endswith(".tmp")]
    if fault == "disk full":  # room again: the resume goes on (once is enough, for time)
        assert main(more) == 0, capsys.readouterr().err
        assert update_of(load_checkpoint(last)) == saved + 2
