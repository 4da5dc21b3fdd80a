"""``training.gradient_checkpointing``: in one process a model recomputes exactly its shard units (the
modules fsdp shards and checkpoints), each unit's forward running again in backward; the gradients do
not change; and a model with nothing to recompute is refused in one line before any work."""
from __future__ import annotations

import pytest
import torch

from mmvl.losses import build_losses
from mmvl.models.base import BaseModel
from mmvl.utils.activation_checkpointing import checkpoint_each, is_checkpointed
from tests.fixtures import tiny_vlm
from tests.models.test_clip import _batch, _clip


@pytest.fixture(scope="module")
def vlm_parts(tmp_path_factory):
    folder = tiny_vlm.make_tiny_lm(tmp_path_factory.mktemp("lm"), layers=2)
    proc = tiny_vlm.processor(folder)
    return folder, proc


def _model_and_loss(name: str, vlm_parts):
    if name == "clip":
        return _clip(), _batch(), build_losses(["clip"])[0][1]
    folder, proc = vlm_parts
    torch.manual_seed(0)
    return (tiny_vlm.build_model(folder, proc), tiny_vlm.collate(proc, tiny_vlm.items(proc)[:3]),
            build_losses(["answer_tokens"])[0][1])


def _step(model, batch, loss) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Forward calls inside each shard unit (of its first child: transformers checkpoints a layer's
    ``forward``, not its ``__call__``, so the unit's own hooks run once) over one forward + backward,
    and the gradients."""
    calls = [0] * len(model.shard_units())
    for i, unit in enumerate(model.shard_units()):
        next(unit.children()).register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    model.train()
    loss(dict(batch), model(dict(batch))).backward()
    return calls, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["vlm", "clip"])
def test_one_process_recomputes_each_shard_unit_and_the_gradients_stay(name, vlm_parts):
    model, batch, loss = _model_and_loss(name, vlm_parts)
    assert len(model.shard_units()) >= 2 and model.checkpointable()
    plain_calls, plain = _step(model, batch, loss)
    model, batch, loss = _model_and_loss(name, vlm_parts)
    model.enable_gradient_checkpointing()
    calls, grads = _step(model, batch, loss)
    assert plain_calls == [1] * len(plain_calls) and calls == [2] * len(calls)  # forward, then again in backward
    assert grads.keys() == plain.keys()
    for key, value in plain.items():
        torch.testing.assert_close(grads[key], value, atol=1e-6, rtol=1e-5, msg=key)


class _Units(BaseModel):
    """A user model with shard units and no switch of its own: the default checkpoints the units."""

    def __init__(self):
        super().__init__(None)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

    def forward(self, batch):
        x = batch["x"]
        for block in self.blocks:
            x = torch.tanh(block(x))
        return {"scores": x}

    def shard_units(self):
        return list(self.blocks)


class _Nothing(BaseModel):
    def forward(self, batch):  # pragma: no cover - never run
        return {}


def test_the_default_switch_checkpoints_the_shard_units_and_nothing_is_refused():
    model = _Units()
    assert model.checkpointable() and not any(is_checkpointed(b) for b in model.blocks)
    model.enable_gradient_checkpointing()
    assert all(is_checkpointed(b) for b in model.blocks)
    assert checkpoint_each(model.blocks) == 2  # again: left as they are
    model(({"x": torch.randn(3, 4, requires_grad=True)}))["scores"].sum().backward()
    assert not _Nothing(None).checkpointable()


def test_gradient_checkpointing_on_a_model_with_nothing_to_recompute_is_one_line_exit_2(tmp_path, capsys,
                                                                                      monkeypatch):
    from mmvl_cli.run import main as run
    from tests.fixtures.toy import ToyModel, register, toy_opts

    register()
    assert run(toy_opts(tmp_path / "units", "training.gradient_checkpointing=true", "training.max_updates=2")) == 0
    capsys.readouterr()
    monkeypatch.setattr(ToyModel, "shard_units", lambda self: [])  # no units, no switch of its own
    assert run(toy_opts(tmp_path / "flat", "training.gradient_checkpointing=true")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "training.gradient_checkpointing=true, but model toy_mlp has nothing to recompute" \
        in err[0] and "training.gradient_checkpointing=false" in err[0]
    assert not (tmp_path / "flat" / "save" / "checkpoints").exists()
