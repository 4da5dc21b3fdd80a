"""A run's parts are built apart from its loop (mmvl/trainers/parts.py), the Trainer's construction
and step each fit on one screen, and the step streams its micro-batches unless the update needs
them together (a loss with ``begin_update``, a cached contrastive update)."""
from __future__ import annotations

import ast
import gc
import inspect
import textwrap
import weakref
from typing import Any

import torch

from mmvl.config import load_config
from mmvl.trainers import Trainer
from mmvl.trainers.parts import RunParts, build_parts
from tests.fixtures.toy import register, toy_opts

register()
SCREEN = 45  # lines


def test_construction_and_step_each_fit_on_one_screen():
    for method in (Trainer.__init__, Trainer.train_step):
        node = ast.parse(textwrap.dedent(inspect.getsource(method))).body[0]
        assert node.end_lineno - node.lineno + 1 <= SCREEN, f"Trainer.{method.__name__} is over {SCREEN} lines"


def test_build_parts_builds_a_run_without_a_loop(tmp_path):
    config = load_config(toy_opts(tmp_path, "training.max_epochs=2", "training.gradient_accumulation=2"))
    parts = build_parts(config)
    assert isinstance(parts, RunParts) and parts.batch_size == 8
    assert parts.max_updates == max(1, int(parts.train_data.batches_per_epoch / 2 * 2.0))  # from max_epochs
    trainable = {id(p) for p in parts.model.parameters() if p.requires_grad}
    assert trainable == {id(p) for g in parts.optimizer.param_groups for p in g["params"]}
    assert parts.scheduler is not None and [name for name, _ in parts.losses] == ["cross_entropy"]
    batch = parts.engine.to_device(next(parts.train_data))
    assert batch["targets"].shape[0] == 8 and set(parts.metrics) == {"toy"}


class Counting:
    """A training stream that counts the batches drawn from it, and sees which are still alive."""

    def __init__(self, stream: Any):
        self.stream, self.drawn, self.tensors = stream, 0, weakref.WeakSet()

    def __next__(self) -> Any:
        self.drawn += 1
        batch = next(self.stream)
        self.tensors.add(batch["features"])
        return batch

    @property
    def alive(self) -> int:
        gc.collect()
        return len(self.tensors)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _trainer(tmp_path, whole_update: bool, *opts: str) -> tuple[Trainer, Counting, list[int]]:
    """A toy Trainer whose stream counts draws, and the draw count at each forward. ``whole_update``:
    its loss gets a ``begin_update`` (doing nothing), so the step draws the whole update first."""
    trainer = Trainer(load_config(toy_opts(tmp_path, "training.gradient_accumulation=3", *opts)))
    trainer.train_data = counting = Counting(trainer.train_data)
    at_forward: list[int] = []
    trainer.model.register_forward_pre_hook(lambda *_: at_forward.append(counting.drawn))
    if whole_update:
        for _, loss in trainer.losses:
            loss.begin_update = lambda batches: None
    return trainer, counting, at_forward


def test_micro_batches_stream_unless_a_loss_needs_the_whole_update(tmp_path):
    trainer, counting, at_forward = _trainer(tmp_path / "stream", False)
    trainer.train_step()  # the first update (and its FLOP-counting passes after it)
    at_forward.clear()
    alive: list[int] = []
    trainer.model.register_forward_pre_hook(lambda *_: alive.append(counting.alive))
    trainer.train_step()
    assert at_forward == [4, 5, 6]  # each drawn after the previous one's forward and backward
    assert alive == [1, 1, 1]  # and the previous one let go: one micro-batch held at a time
    trainer, _, at_forward = _trainer(tmp_path / "whole", True)
    seen: list[int] = []
    trainer.losses[0][1].begin_update = lambda batches: seen.append(len(batches))
    trainer.train_step()
    at_forward.clear()
    trainer.train_step()
    assert seen == [3, 3] and at_forward == [6, 6, 6]


def test_streaming_is_bitwise_the_update_drawn_whole(tmp_path):
    """Same weights, losses and counts whichever way the micro-batches are drawn (dropout on: the
    forward's randomness comes in the same order)."""
    opts = ("model_config.toy_mlp.hidden_dropout_prob=0.2", "training.batch_size=4", "training.max_updates=4")
    runs = []
    for whole in (False, True):
        trainer, counting, _ = _trainer(tmp_path / str(whole), whole, *opts)
        infos = [trainer.train_step() for _ in range(4)]
        params = trainer.engine.unwrap_model(trainer.model).state_dict()
        runs.append((counting.drawn, params, infos))
    (drawn_a, params_a, infos_a), (drawn_b, params_b, infos_b) = runs
    assert drawn_a == drawn_b == 12
    assert all(torch.equal(v, params_b[k]) for k, v in params_a.items())
    for a, b in zip(infos_a, infos_b):
        assert all(torch.equal(v, b["losses"][k]) for k, v in a["losses"].items())
        assert (a["tokens"], a["samples"], a["lr"]) == (b["tokens"], b["samples"], b["lr"])
