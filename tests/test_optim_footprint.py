"""The start-of-run line ``parameters + optimizer state per rank``: parameters, gradients of what
trains, and the optimizer's state counted before its first step as it is after that step."""
from __future__ import annotations

import re

import pytest
import torch

from mmvl import registry
from mmvl.optim.footprint import footprint_line, optimizer_state_bytes

OPTIONS = {"sgd": [{"momentum": 0.9}, {"momentum": 0.0}], "adam": [{}, {"amsgrad": True}], "adam_w": [{}]}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    model[0].requires_grad_(False)  # frozen: no gradient, no optimizer state
    return model


def test_every_registered_optimizer_has_options_here():
    import mmvl.optim  # noqa: F401  (registers them)

    assert set(registry.OPTIMIZERS.names()) == set(OPTIONS)


@pytest.mark.parametrize("name, options", [(n, o) for n, opts in OPTIONS.items() for o in opts])
def test_the_state_counted_before_the_first_step_is_the_state_after_it(name, options):
    model = _model()
    optimizer = registry.OPTIMIZERS.get(name)(model.parameters(), lr=0.1, **options)
    before = optimizer_state_bytes(optimizer)
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    assert optimizer_state_bytes(optimizer) == before
    trained = 4 * (16 * 4 + 4)  # float32 bytes of the second layer
    assert before == trained * {"sgd": 1 if options.get("momentum") else 0}.get(name, 3 if options else 2)


def test_the_line_adds_parameters_gradients_and_state():
    model = _model()
    line = footprint_line(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    mb = 2 ** 20
    params, grads = 4 * (8 * 16 + 16 + 16 * 4 + 4) / mb, 4 * (16 * 4 + 4) / mb
    expected = (f"parameters + optimizer state per rank: {params + 3 * grads:.4g} MB (parameters {params:.4g} MB, "
                f"gradients {grads:.4g} MB, optimizer state {2 * grads:.4g} MB after its first step)")
    assert line == expected


def test_an_unknown_optimizer_says_its_state_is_not_counted():
    class Custom(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

    line = footprint_line(_model(), Custom(_model().parameters()))
    assert re.match(r"parameters \+ gradients per rank: [\d.]+ MB .*the state of Custom is not counted\)$", line)
