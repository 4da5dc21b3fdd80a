"""SIGKILL a real ``mmvl_run`` again and again (between checkpoints and inside checkpoint writes);
each restart with ``checkpoint.resume=auto`` continues, and the end result is bitwise the
uninterrupted run's (parameters and optimizer state)."""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mmvl.checkpoint import CheckpointManager
from mmvl.io import safe_load
from mmvl_cli.run import main
from tests.fixtures.faults import ROOT, SCRIPT, child_env, run_faulty
from tests.fixtures.toy import register, toy_opts

register()
KILLED = -signal.SIGKILL
RNG_SEED = 1234


def _opts(root: Path, updates: int, interval: int, kind: str = "toy") -> list[str]:
    # dropout on, evaluation (and best checkpoints) mid-run, 2+ epochs: everything a resume must restore
    common = [f"training.max_updates={updates}", f"training.checkpoint_interval={interval}",
              "training.evaluation_interval=5", "checkpoint.max_to_keep=3", "training.log_interval=1",
              "checkpoint.resume=auto"]
    if kind == "toy":
        return toy_opts(root, *common, "model_config.toy_mlp.hidden_dropout_prob=0.1",
                        "training.early_stop.criteria=toy/accuracy")
    return sort_of_clevr_opts(root) + common


def sort_of_clevr_opts(root: Path) -> list[str]:
    """Sort-of-CLEVR (32 training images, 32 px) and a one-layer VisualBERT with a small CNN."""
    d, m = "dataset_config.sort_of_clevr", "model_config.visual_bert"
    return ["model=visual_bert", "datasets=sort_of_clevr", f"env.save_dir={root}/save",
            f"env.data_dir={root.parent}/data", f"{d}.num_images=32", f"{d}.num_val_images=8",
            f"{d}.num_test_images=8", f"{d}.questions_per_image=1", f"{d}.image_size=32", f"{d}.object_size=2",
            f"{m}.hidden_size=16", f"{m}.num_hidden_layers=1", f"{m}.num_attention_heads=2",
            f"{m}.intermediate_size=32", f"{m}.image_size=32",
            f"{m}.image_encoder={{type: cnn, params: {{channels: [4, 8], strides: [4, 4]}}}}",
            "training.batch_size=8", "training.num_workers=0", "training.progress_bar=false",
            "scheduler.params.num_warmup_steps=2", "optimizer.params.lr=0.001"]


def _ckpt_dir(root: Path) -> Path:
    return root / "save" / "checkpoints"


def _resume_point(root: Path) -> int:
    """The update the next run resumes from (what ``checkpoint.resume=auto`` will load)."""
    found = CheckpointManager(root / "save").load_latest()
    return int(found[0]["trainer"]["update"]) if found else 0


def _tensors(state: dict) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in state["model"].items()}
    for pid, s in state["optimizer"]["state"].items():
        out.update({f"optimizer.{pid}.{k}": v for k, v in s.items() if isinstance(v, torch.Tensor)})
    return out


def _assert_bitwise_equal(root: Path, reference: Path) -> None:
    got = _tensors(safe_load(_ckpt_dir(root) / "last.ckpt"))
    want = _tensors(safe_load(_ckpt_dir(reference) / "last.ckpt"))
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), f"{k} differs from the uninterrupted run"


def _resumed_at(root: Path) -> list[int]:
    text = (root / "save" / "train.log").read_text()
    return [int(u) for u in re.findall(r"Resumed from \S+ at update (\d+)", text)]


def _reference(root: Path, updates: int, interval: int, kind: str = "toy") -> Path:
    assert main(_opts(root, updates, interval, kind)) == 0
    return root


def _kill_at_update(root: Path, opts: list[str], rng: random.Random, updates: int, interval: int) -> int:
    start = _resume_point(root)
    kill = rng.randint(start + 1, min(start + 2 * interval + 1, updates - 1))
    proc = run_faulty(opts, [{"update": kill, "action": "sigkill", "when": rng.choice(["before", "after"])}])
    assert proc.returncode == KILLED, proc.stderr
    saved = _resume_point(root)
    assert start <= saved < kill and saved >= kill - interval - 1, (start, kill, saved)
    return saved


def _kill_in_save(root: Path, opts: list[str], phase: str, call: int = 2) -> int:
    """SIGKILL inside this process's ``call``-th checkpoint write; the previous one must survive."""
    start = _resume_point(root)
    proc = run_faulty(opts, [{"save": call, "phase": phase}])
    assert proc.returncode == KILLED, proc.stderr
    saved = _resume_point(root)  # last.ckpt loads: the interrupted write did not damage it
    assert saved > start, "the first save of the attempt should have completed"
    names = os.listdir(_ckpt_dir(root))
    if phase in ("write", "rename"):
        assert any(n.endswith(".tmp") for n in names), names  # the kill really was mid-write
    return saved


def _finish(root: Path, opts: list[str], reference: Path, resumes: list[int]) -> None:
    proc = run_faulty(opts)
    assert proc.returncode == 0, proc.stderr
    assert _resumed_at(root) == [r for r in resumes if r]  # each restart picked up the newest complete checkpoint
    assert not [n for n in os.listdir(_ckpt_dir(root)) if n.endswith(".tmp")]  # stale temps cleaned
    _assert_bitwise_equal(root, reference)


@pytest.mark.slow  # three killed processes and a resume
def test_three_kills_then_bitwise_equal(tmp_path):
    """CI form: SIGKILL at a random update, inside a checkpoint write, at another random update."""
    updates, interval = 12, 2
    reference = _reference(tmp_path / "ref", updates, interval)
    root, rng = tmp_path / "run", random.Random(RNG_SEED)
    opts = _opts(root, updates, interval)
    resumes = [_kill_at_update(root, opts, rng, updates, interval)]
    resumes.append(_kill_in_save(root, opts, "write"))
    resumes.append(_kill_at_update(root, opts, rng, updates, interval))
    _finish(root, opts, reference, resumes)


def _kill_from_outside(root: Path, opts: list[str], rng: random.Random) -> int:
    """SIGKILL from another process at a random moment once training is under way (like the OOM killer)."""
    start = _resume_point(root)
    slow = [{"update": 1, "action": "sleep", "seconds": 0.05}]
    proc = subprocess.Popen([sys.executable, SCRIPT, *opts], cwd=ROOT, env=child_env(slow),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = root / "save" / "metrics.jsonl"
    seen = metrics.stat().st_size if metrics.exists() else 0
    deadline = time.monotonic() + 60
    while (not metrics.exists() or metrics.stat().st_size == seen) and proc.poll() is None:
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.02)
    time.sleep(rng.uniform(0.0, 0.3))
    proc.kill()
    proc.communicate(timeout=30)
    assert proc.returncode == KILLED
    return _resume_point(root)


LONG = {  # kind, interval, updates, kill plan, stop when this close to the end
    "toy-every-update": ("toy", 1, 32, ("update", "write", "update", "rename", "outside", "link", "update",
                                         "torn", "outside"), 8),
    "toy-every-2": ("toy", 2, 32, ("update", "write", "update", "rename", "outside", "link", "update",
                                   "torn", "outside"), 8),
    "sort_of_clevr": ("sort_of_clevr", 2, 12, ("update", "write", "outside", "link"), 3),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LONG))
def test_many_kills_then_bitwise_equal(tmp_path, name):
    """Long form: up to 9 kills over 4 epochs (toy), every save phase, a torn last.ckpt, kills from
    outside; and Sort-of-CLEVR with VisualBERT."""
    kind, interval, updates, plan, margin = LONG[name]
    reference = _reference(tmp_path / "ref", updates, interval, kind)
    root, rng = tmp_path / "run", random.Random(f"{RNG_SEED}-{name}")
    opts = _opts(root, updates, interval, kind)
    resumes: list[int] = []
    for step in plan:
        if _resume_point(root) >= updates - margin:
            break
        if step == "update":
            resumes.append(_kill_at_update(root, opts, rng, updates, interval))
        elif step == "outside":
            resumes.append(_kill_from_outside(root, opts, rng))
        elif step == "torn":  # a disk that lost the tail of last.ckpt: fall back to an older file
            last = _ckpt_dir(root) / "last.ckpt"
            data = last.read_bytes()
            last.write_bytes(data[: len(data) // 3])
            resumes[-1] = _resume_point(root)  # an older periodic file
            resumes.append(_kill_at_update(root, opts, rng, updates, interval))
        else:
            resumes.append(_kill_in_save(root, opts, step))
    assert len(resumes) >= len(plan) - 1
    _finish(root, opts, reference, resumes)
