"""benchmarks/parity.py: a few updates of mmvl's Trainer and of the hand-written plain loop give the same weights."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import parity  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("easy_vqa") is None,
                                reason="the easy-vqa package is not installed (pip install mmvl[easy_vqa])")


@pytest.mark.parametrize("model", parity.MODELS)
def test_the_trainer_trains_as_the_plain_loop(model):
    """relation_network with dropout, evaluated after every update: the evaluations must not move the
    training's dropout draws (they did, through the evaluation loader's seed drawn from the global RNG)."""
    extra = ["training.batch_size=16", "scheduler.params.num_warmup_steps=1"]
    dropout = ["model_config.relation_network.f_dropout=0.5"] if model == "relation_network" else []
    result = parity.run(model, updates=3, max_samples=256, atol=1e-6, rtol=1e-5, extra=extra + dropout,
                        evaluate_every=1 if dropout else None)
    assert result["moved"] > 1e-4  # the weights trained
    assert result["equal"], result


def test_compare_finds_a_difference():
    a = {"w": torch.zeros(3), "b": torch.ones(2)}
    assert parity.compare(a, {"w": torch.zeros(3), "b": torch.ones(2)}, 1e-6, 0)[0]
    ok, worst, where = parity.compare(a, {"w": torch.tensor([0, 1e-3, 0]), "b": torch.ones(2)}, 1e-6, 0)
    assert not ok and where == "w" and worst == pytest.approx(1e-3)
    assert not parity.compare(a, {"w": torch.zeros(3)}, 1e-6, 0)[0]
