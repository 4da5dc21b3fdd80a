"""Registries drive tests: every registered model loads from its tiny config, runs forward and
backward on generated data, and learns (the loss on a fixed batch goes down).

A model registered without ``tests/models/tiny/<model>.yaml`` fails here: the tiny config is a
config layer for ``load_config(["config=<file>", ...])`` that trains in seconds on generated data
(see the files next to this one).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import mmvl  # noqa: F401  (registers the built-in models)
from mmvl.build import build_datasets, build_model, model_config
from mmvl.config import load_config
from mmvl.losses import build_losses, compute_losses
from mmvl.optim import build_optimizer
from mmvl.registry import MODELS

TINY = Path(__file__).resolve().parent / "tiny"
STEPS = 20
#: the models mmvl registers (test fixtures register their own, e.g. toy_mlp, which ship nothing)
SHIPPED = [name for name in MODELS.names() if MODELS.get(name).__module__.startswith("mmvl.")]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """One generated copy of the tiny configs' data for every model."""
    return tmp_path_factory.mktemp("tiny_data")


def _build(name: str, data_dir: Path, save_dir: Path):
    path = TINY / f"{name}.yaml"
    assert path.is_file(), (f"registered model {name!r} has no tiny config: add {path.relative_to(TINY.parents[2])} "
                            f"(a config layer with model: {name} that trains in seconds on generated data)")
    config = load_config([f"config={path}", f"env.data_dir={data_dir}", f"env.save_dir={save_dir}"])
    assert config.model == name
    torch.manual_seed(0)
    builders = build_datasets(config)
    for builder in builders.values():
        builder.prepare()
    model = build_model(config, builders)
    losses = build_losses(list(model_config(config, builders).get("losses") or []))
    (builder,) = builders.values()
    loader = torch.utils.data.DataLoader(builder.build("train"), batch_size=int(config.training.batch_size),
                                         shuffle=False, collate_fn=builder.collate)
    return config, model, losses, build_optimizer(model, config), next(iter(loader))


def _loss(model, losses, batch) -> torch.Tensor:
    output = model(batch)
    assert "scores" in output and output["scores"].shape[0] == len(batch["targets"])
    values = compute_losses(losses, batch, output)
    assert values, "the model returned no losses and its config lists none"
    return sum(values.values())


@pytest.mark.parametrize("name", SHIPPED)
def test_registered_model_forward_backward_and_learns(name, data_dir, tmp_path):
    config, model, losses, optimizer, batch = _build(name, data_dir, tmp_path)
    model.train()
    loss = _loss(model, losses, batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with_grad = [n for n, p in trainable if p.grad is not None and p.grad.abs().sum() > 0]
    assert trainable and len(with_grad) >= 0.9 * len(trainable), (
        f"{name}: only {len(with_grad)} of {len(trainable)} trainable tensors got a gradient")
    assert all(torch.isfinite(p.grad).all() for _, p in trainable if p.grad is not None)

    first = float(loss.detach())
    optimizer.step()
    for _ in range(STEPS - 1):
        optimizer.zero_grad()
        loss = _loss(model, losses, batch)
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        last = float(_loss(model, losses, batch))
    assert last < 0.75 * first, f"{name}: loss on a fixed batch went {first:.4f} -> {last:.4f} in {STEPS} updates"


def test_every_tiny_config_names_a_registered_model():
    """A tiny config for a model that is no longer registered is dead weight."""
    names = {p.stem for p in TINY.glob("*.yaml") if not p.stem.startswith("_")}
    assert names <= set(SHIPPED), sorted(names - set(SHIPPED))
    assert {"visual_bert", "mmbt", "concat_bert"} <= set(SHIPPED)
