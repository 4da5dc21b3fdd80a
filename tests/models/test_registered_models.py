"""Registries drive tests: every registered model loads from its tiny config, runs forward and
backward on generated data, and learns (the loss on a fixed batch goes down).

A model registered without ``tests/models/tiny/<model>.yaml`` fails here: the tiny config is a
config layer for ``load_config(["config=<file>", ...])`` that trains in seconds on generated data
(see the files next to this one).
"""
from __future__ import annotations

import pytest
import torch

from tests.fixtures.tiny_models import CASES, SHIPPED, TINY, build_tiny
from mmvl.losses import compute_losses

STEPS = 20


def _loss(model, losses, batch) -> torch.Tensor:
    output = model(batch)
    assert "scores" in output and output["scores"].shape[0] == len(batch["targets"])
    values = compute_losses(losses, batch, output)
    assert values, "the model returned no losses and its config lists none"
    return sum(values.values())


@pytest.mark.parametrize("name, variant", CASES)
def test_registered_model_forward_backward_and_learns(name, variant, tiny_data_dir, tmp_path):
    config, model, losses, optimizer, batch = build_tiny(name, tiny_data_dir, tmp_path, variant)
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
