"""Strategies say what they can do; the Engine, evaluation and callbacks ask that, never a name.

A strategy of a user's own (registered under any name) that shards its parameters must be
treated as FSDP is: no per-rank decoding, no EMA copy, clipping through the strategy.
"""
from __future__ import annotations

import pytest
import torch

from mmvl.config import load_config
from mmvl.distributed.env import DistEnv
from mmvl.distributed.strategies.single import SingleStrategy
from mmvl.engine import DistributedType, Engine
from mmvl.errors import UserError
from mmvl.registry import STRATEGIES

CAPABILITIES = ("needs_process_group", "shards_optimizer_state", "shards_parameters", "full_gradients",
                "replicas_in_one_process", "communicates_in_backward", "handles_gradient_checkpointing")


@pytest.mark.parametrize("name", STRATEGIES.names())
def test_every_strategy_declares_each_capability_as_a_bool(name):
    cls = STRATEGIES.get(name)
    assert {c: type(getattr(cls, c)) for c in CAPABILITIES} == {c: bool for c in CAPABILITIES}
    # what shards the parameters cannot hold whole gradients on every rank
    assert not (cls.shards_parameters and cls.full_gradients)


class _ShardingSingle(SingleStrategy):
    """A one-process strategy under another name that declares sharded parameters."""

    name = "my_sharding"
    shards_parameters = True
    full_gradients = False


def test_the_engine_asks_the_strategy_not_its_name():
    env = DistEnv()
    plain = Engine(env=env, strategy=SingleStrategy(load_config([]), env))
    assert plain.distributed_type == DistributedType.NO
    engine = Engine(env=env, strategy=_ShardingSingle(load_config([]), env))
    assert engine.distributed_type == DistributedType.FSDP
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    model, optimizer = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    engine.backward(model(torch.randn(2, 3)).sum())
    with pytest.raises(UserError, match="clips the whole prepared model only"):
        engine.clip_grad_norm_(list(model.parameters())[:1], 1.0)
    assert torch.isfinite(engine.clip_grad_norm_(model.parameters(), 1.0))
