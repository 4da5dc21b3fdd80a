"""Named checkpointables: what registered objects save and get back, through the Engine and a resume."""
from __future__ import annotations

import pytest
import torch

from mmvl.checkpoint import Checkpointables, State, schema
from mmvl.config import load_config
from mmvl.engine import Engine
from mmvl.errors import UserError
from mmvl.trainers import Trainer
from tests.fixtures.toy import register, toy_opts


class Counter:
    def __init__(self, n: int = 0):
        self.n = n

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = int(state["n"])


def test_states_by_name_loaded_in_schema_order():
    order = []
    c = Checkpointables()
    c.register("ema", State(lambda: {"x": 1}, lambda s: order.append("ema")))
    c.register(schema.OPTIMIZER, State(lambda: {"o": 1}, lambda s: order.append("optimizer")))
    c.register(schema.MODEL, State(lambda: {"m": 1}, lambda s: order.append("model")))
    state = c.state_dict()
    assert list(state) == [schema.MODEL, schema.OPTIMIZER, "ema", schema.FORMAT]
    assert state[schema.FORMAT] == schema.FORMAT_VERSION
    assert c.load_state_dict({**state, schema.OPTIMIZER: None}) == [schema.OPTIMIZER]
    assert order == ["model", "ema"]
    assert schema.MODEL not in c.state_dict(skip=schema.SHARDED_KEYS)


def test_registration_mistakes_are_user_errors():
    c = Checkpointables()
    with pytest.raises(UserError, match="needs state_dict"):
        c.register("thing", object())
    c.register("ema", Counter())
    c.register("ema", c["ema"])  # the same object again: fine
    with pytest.raises(UserError, match="already registered"):
        c.register("ema", Counter())
    with pytest.raises(UserError, match="cannot name"):
        c.register(schema.FORMAT, Counter())


def test_engine_save_state_keeps_a_registered_object(tmp_path):
    engine = Engine(device="cpu")
    model = torch.nn.Linear(2, 2)
    model, _ = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    counter = Counter(5)
    engine.register_checkpointable("counter", counter)
    engine.save_state(tmp_path / "state.ckpt")
    counter.n = 9
    engine.load_state(tmp_path / "state.ckpt")
    assert counter.n == 5


def test_a_user_checkpointable_survives_a_trainer_resume(tmp_path):
    register()
    opts = toy_opts(tmp_path, "training.evaluation_interval=0", "training.max_updates=6",
                    "training.checkpoint_interval=3")
    counted = Counter(41)
    first = Trainer(load_config(opts + ["checkpoint.resume=false"]), checkpointables={"counted": counted})
    first.fit()
    assert torch.load(first.checkpoints.last_path, weights_only=True)["counted"] == {"n": 41}
    again = Counter()
    second = Trainer(load_config(opts + ["training.max_updates=9"]), checkpointables={"counted": again})
    assert second.update == 6 and again.n == 41  # resume=auto gave it back before training
