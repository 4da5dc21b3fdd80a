"""``distributed.sharded_checkpoint=true`` under fsdp on 2 real gloo processes: periodic saves are
``sharded_<update>/`` directories written by every rank (no gather), a stop at 10 + resume to 20
equals an uninterrupted 20, a directory without its marker is skipped, ``max_to_keep`` prunes,
and a world-2 sharded checkpoint resumes under ddp and at world 1 (DCP re-shards)."""
from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch

from mmvl import registry
from mmvl import io
from mmvl.checkpoint.schema import SHARDED_STATE
from mmvl.io import safe_load
from mmvl.config import load_config
from mmvl.errors import UserError
from mmvl.trainers import Trainer
from tests.distributed.dist_launch import launch
from tests.fixtures.toy import register, toy_opts

class SignalAt:
    """Rank 0 gets SIGUSR1 (SLURM's warning) after ``update``. With a check after every update
    (``training.preemption_check_interval=1``) the flag goes into the all-reduce started after the
    next update and is read one update later: every rank saves and stops at ``update + 2``."""

    def __new__(cls, trainer, update: int):
        from mmvl.trainers.callbacks import Callback

        class _SignalAt(Callback):
            def on_update_end(self, info):
                if self.trainer.update == update and self.trainer.env.rank == 0:
                    os.kill(os.getpid(), signal.SIGUSR1)

        return _SignalAt(trainer)


def _register() -> None:
    register()
    if "signal_at" not in registry.CALLBACKS:
        registry.CALLBACKS.register("signal_at", SignalAt)


_register()


def _opts(root: str, *extra: str) -> list[str]:
    return toy_opts(root, "distributed.strategy=fsdp", "distributed.sharded_checkpoint=true",
                    "training.max_updates=20", "training.gradient_accumulation=2",
                    "training.clip_grad_norm=0.5", "training.checkpoint_interval=5",
                    "training.evaluation_interval=10", "checkpoint.max_to_keep=2",
                    "checkpoint.resume=false", "optimizer.params.lr=0.02", *extra)


def _runs(env, root: str) -> dict:
    """On every rank: an uninterrupted run; a run stopped at 10, a torn sharded_15, then resume=auto."""
    from mmvl.distributed.strategies.fsdp import FSDPStrategy

    _register()
    torch.set_num_threads(1)
    current, gathers = {}, []  # the updates at which a full model state was gathered
    original = FSDPStrategy.model_state_dict

    def recording(self, model):
        gathers.append(current["trainer"].update)
        return original(self, model)

    FSDPStrategy.model_state_dict = recording

    def fit(sub: str, *extra: str) -> Trainer:
        current["trainer"] = Trainer(load_config(_opts(f"{root}/{sub}", *extra)), env=env)
        current["trainer"].fit()
        return current["trainer"]

    fit("full")
    out = {"full_gathers": list(gathers)}
    fit("part", "training.callbacks=[{type: stop_at, params: {update: 10}}]")
    ckpts = f"{root}/part/save/checkpoints"
    out["stopped_files"] = sorted(os.listdir(ckpts))
    torch.distributed.barrier()
    if env.rank == 0:  # as after a crash: no end-of-run export, and update 15's save torn mid-write
        os.remove(f"{ckpts}/last.ckpt")
        shutil.copytree(f"{ckpts}/sharded_10", f"{ckpts}/sharded_15")
        os.remove(f"{ckpts}/sharded_15/{io.MARKER}")
    torch.distributed.barrier()
    resumed = fit("part", "checkpoint.resume=auto")
    out["resumed_from"] = resumed.resumed_from
    # preemption: the save is sharded too, and there is no end-of-run export (the job is dying)
    before = len(gathers)
    stopped = fit("preempt", "training.callbacks=[{type: signal_at, params: {update: 7}}]",
                  "training.preemption_check_interval=1")
    out["preempted"] = (stopped.preempted, stopped.update, len(gathers) - before,
                        sorted(os.listdir(f"{root}/preempt/save/checkpoints")))
    out["preempt_resumed_from"] = fit("preempt", "checkpoint.resume=true").resumed_from
    # the same sharded checkpoint under another strategy (ddp: replicated, DCP gathers the shards)
    ddp = Trainer(load_config(_opts(f"{root}/ddp", "distributed.strategy=ddp",
                                    f"checkpoint.resume_file={root}/full/save/checkpoints/sharded_15")), env=env)
    out["ddp_started_at"] = ddp.update
    ddp.fit()
    return out


@pytest.mark.slow  # gloo processes at two world sizes
def test_sharded_checkpoints_resume_prune_and_reshard(tmp_path):
    results = launch(_runs, world_size=2, args=(str(tmp_path),), timeout=300)
    r = results[0]
    # periodic saves at 5 and 15 gathered nothing; full states only for best.ckpt (evaluations at
    # 10 and 20) and the end-of-training last.ckpt
    assert 20 in r["full_gathers"] and set(r["full_gathers"]) <= {10, 20}, r["full_gathers"]
    assert r["stopped_files"] == ["best.ckpt", "last.ckpt", "sharded_10", "sharded_5"]
    assert r["resumed_from"].endswith("sharded_10") and results[1]["resumed_from"] == r["resumed_from"]

    assert r["preempted"] == ("SIGUSR1", 9, 0, ["sharded_5", "sharded_9"])
    assert r["preempt_resumed_from"].endswith("sharded_9")

    for run in ("full", "part", "preempt"):
        ckpts = tmp_path / run / "save" / "checkpoints"
        # max_to_keep=2: 5 and 10 pruned; the torn sharded_15 was rewritten by the resumed run
        assert sorted(os.listdir(ckpts)) == ["best.ckpt", "last.ckpt", "sharded_15", "sharded_20"]
        for update in (15, 20):
            d = ckpts / f"sharded_{update}"
            files = json.loads((d / io.MARKER).read_text())["files"]
            assert sorted(files) == [".metadata", "__0_0.distcp", "__1_0.distcp", SHARDED_STATE]
            rest = safe_load(d / SHARDED_STATE, expect_keys=("trainer",))
            assert "model" not in rest and "optimizer" not in rest
            counters = rest["trainer"]
            assert (counters["update"], counters["world_size"], len(rest["rng"])) == (update, 2, 2)
            assert counters["best_update"] is not None and counters["best_update"] <= update  # best.ckpt's
            assert {"scheduler", "data", "callbacks", "config"} <= set(rest)
    full = safe_load(tmp_path / "full" / "save" / "checkpoints" / "last.ckpt")
    for run in ("part", "preempt"):
        resumed = safe_load(tmp_path / run / "save" / "checkpoints" / "last.ckpt")
        assert full["trainer"]["update"] == resumed["trainer"]["update"] == 20
        for k, v in full["model"].items():
            assert torch.equal(resumed["model"][k], v), f"{run}: resumed != uninterrupted at {k}"

    ddp = safe_load(tmp_path / "ddp" / "save" / "checkpoints" / "last.ckpt")["model"]
    assert r["ddp_started_at"] == 15
    for k, v in full["model"].items():
        torch.testing.assert_close(ddp[k], v, atol=1e-5, rtol=0, msg=f"fsdp -> ddp: {k}")

    # the world-2 sharded_15 resumes in one process (DCP re-shards)
    torch.set_num_threads(1)
    one = ("distributed.strategy=single", "distributed.sharded_checkpoint=false")
    single = Trainer(load_config(_opts(str(tmp_path / "single"), *one)))
    single.fit()
    w1 = Trainer(load_config(_opts(str(tmp_path / "w1"), *one, "checkpoint.resume_file="
                                   f"{tmp_path / 'full' / 'save' / 'checkpoints' / 'sharded_15'}")))
    assert w1.update == 15
    w1.fit()
    reference = single.engine.unwrap_model(single.model).state_dict()
    for k, v in w1.engine.unwrap_model(w1.model).state_dict().items():
        torch.testing.assert_close(v, reference[k], atol=1e-5, rtol=0, msg=f"world 2->1: {k}")
        torch.testing.assert_close(v, full["model"][k], atol=1e-5, rtol=0, msg=f"world 2->1: {k}")


def test_incomplete_sharded_resume_file_is_a_user_error(tmp_path):
    torn = tmp_path / "sharded_3"
    torn.mkdir()
    (torn / ".metadata").write_bytes(b"m")  # a save that died before the marker
    with pytest.raises(UserError, match=r"sharded_3' is incomplete: no COMPLETE.json"):
        Trainer(load_config(toy_opts(tmp_path, f"checkpoint.resume_file={torn}")))
