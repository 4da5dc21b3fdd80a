"""Frozen parts under every 2-rank strategy (2 gloo processes, the real Trainer): no gradient, no
optimizer state, unchanged values, and a strict resume of the checkpoint; every registered model
with its ``base`` frozen under ddp and fsdp.

``visual_bert`` with ``embeddings`` frozen mixes frozen and trainable tensors in one FSDP unit (the
root: BERT's embeddings next to the visual embeddings and the head); ``mmbt`` with
``text_encoder`` frozen freezes whole FSDP units (BERT's layers).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from mmvl.checkpoint import canonical_key
from mmvl.config import load_config
from mmvl.io import safe_load
from mmvl.registry import MODELS
from tests.fixtures.tiny_models import tiny_opts

#: (strategy, model, part, resumed): ddp and fsdp resumed from their checkpoints; a second fsdp
#: layout and the ZeRO strategies trained only (the slow suite's time is short)
#: the models mmvl registers (from the registry), each with its ``base`` frozen under ddp and fsdp
SHIPPED = [name for name in MODELS.names() if MODELS.get(name).__module__.startswith("mmvl.")]
CASES = [("ddp", "visual_bert", "embeddings", True), ("fsdp", "visual_bert", "embeddings", True),
         ("fsdp", "mmbt", "text_encoder", False), ("zero_torch", "visual_bert", "embeddings", False),
         ("zero_fairscale", "visual_bert", "embeddings", False),
         *((strategy, name, "base", True) for name in SHIPPED for strategy in ("ddp", "fsdp"))]
UPDATES = 2


def _config(strategy: str, model: str, part: str, workdir: str, updates: int):
    return load_config([*tiny_opts(model, Path(workdir) / "data"),
                        f"env.save_dir={workdir}/{strategy}_{model}_{part}", f"distributed.strategy={strategy}",
                        f"model_config.{model}.freeze=[{part}]", f"training.max_updates={updates}",
                        f"training.checkpoint_interval={UPDATES}", "training.evaluation_interval=0",
                        "run_type=train", "training.batch_size=8", "distributed.backend=gloo",
                        "training.builtin_callbacks=[logging,checkpoint]"])


def _frozen_checks(env, strategy: str, model: str, part: str, workdir: str, updates: int) -> dict[str, Any]:
    from mmvl.trainers import Trainer

    trainer = Trainer(_config(strategy, model, part, workdir, updates), env=env)
    inner = trainer.engine.unwrap_model(trainer.model)
    named = dict(inner.named_parameters())
    frozen = {n for n, p in named.items() if not p.requires_grad}
    start = {canonical_key(k): v.detach().clone()  # a collective (full on rank 0), copied before training
             for k, v in trainer.engine.strategy.model_state_dict(trainer.model).items()}
    graded: set[str] = set()
    step = trainer.optimizer.step

    def recording_step(*args: Any, **kwargs: Any) -> Any:
        graded.update(n for n, p in named.items() if p.grad is not None)
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    trainer.fit()
    optimizer = trainer.optimizer.optimizer
    in_groups = {id(p) for group in optimizer.param_groups for p in group["params"]}
    with_state = {id(p) for p in getattr(optimizer, "optim", optimizer).state}
    return {"frozen": sorted(frozen), "graded": sorted(graded), "trainable": sorted(set(named) - frozen),
            "frozen_in_optimizer": sorted(n for n in frozen if id(named[n]) in in_groups | with_state),
            "start": start if env.is_main_process else {}, "resumed_from": trainer.resumed_from,
            "update": trainer.update}


def _run_cases(env, workdir: str) -> list[dict[str, Any]]:
    """Every case trained for UPDATES updates, then (``resumed``) from its checkpoint for UPDATES more."""
    import time

    out = []
    for strategy, model, part, resumed in CASES:
        t = time.monotonic()
        runs = {"first": _frozen_checks(env, strategy, model, part, workdir, UPDATES)}
        if resumed:
            runs["resumed"] = _frozen_checks(env, strategy, model, part, workdir, 2 * UPDATES)
        out.append({**runs, "seconds": time.monotonic() - t})
    return out


@pytest.mark.slow  # one 2-process gloo group, seven short Trainer runs
def test_frozen_parts_under_every_two_rank_strategy(tmp_path):
    from dist_launch import launch

    ranks = launch(_run_cases, world_size=2, args=(str(tmp_path),), timeout=300)
    print("seconds per case:", [round(r["seconds"], 1) for r in ranks[0]])
    for (strategy, model, part, _), results in zip(CASES, ranks[0]):
        where = f"{strategy} {model} freeze=[{part}]"
        first, resumed = results["first"], results.get("resumed")
        assert first["frozen"] and first["trainable"], where
        for run in (first, resumed) if resumed else (first,):
            assert not set(run["frozen"]) & set(run["graded"]), f"{where}: a frozen tensor got a gradient"
            assert set(run["graded"]) == set(run["trainable"]), f"{where}: a trainable tensor got none"
            assert not run["frozen_in_optimizer"], f"{where}: optimizer state for {run['frozen_in_optimizer']}"
        assert first["resumed_from"] is None and first["update"] == UPDATES, where
        if resumed:
            assert resumed["resumed_from"] and resumed["update"] == 2 * UPDATES, where
        checkpoint = safe_load(os.path.join(tmp_path, f"{strategy}_{model}_{part}", "checkpoints", "last.ckpt"))
        final = {canonical_key(k): v for k, v in checkpoint["model"].items()}
        start = first["start"]
        assert set(final) == set(start), where
        for name in first["frozen"]:
            assert torch.equal(final[canonical_key(name)], start[canonical_key(name)]), f"{where}: {name} changed"
        assert any(not torch.equal(final[canonical_key(n)], start[canonical_key(n)]) for n in first["trainable"]), where
    for rank in ranks[1:]:
        assert [r["first"]["graded"] for r in rank] == [r["first"]["graded"] for r in ranks[0]]
