"""``LocalSGD`` on the Engine (Accelerate's meaning): no gradient sync inside the block, parameters
averaged over the ranks every K steps and on leaving it; refused under sharding strategies; and
Accelerate's ``by_feature/local_sgd.py`` (tests/engine/ports/local_sgd.py) follows Accelerate's own
trajectory when only its import lines change."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from mmvl.engine import LocalSGD
from mmvl.errors import UserError

K, STEPS = 3, 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _data(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    return [(torch.randn(5, 4, generator=g), torch.randn(5, 1, generator=g)) for _ in range(STEPS)]


def _vector(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def _train(env) -> dict:
    """STEPS steps of momentum SGD under LocalSGD(K) on this rank's data, the parameters after each
    and after the block; and the same steps on a plain copy with no communication at all."""
    from mmvl.engine import Engine

    engine = Engine(env=env, strategy="ddp")
    plain = _model()
    model = _model()
    model, optimizer = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    steps, alone = [], []
    with LocalSGD(accelerator=engine, model=model, local_sgd_steps=K) as local_sgd:
        for x, y in _data(env.rank):
            with engine.accumulate(model):
                engine.backward(torch.nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
                local_sgd.step()
            steps.append(_vector(model))
            torch.nn.functional.mse_loss(plain(x), y).backward()
            plain_optimizer.step()
            plain_optimizer.zero_grad()
            alone.append(_vector(plain))
    return {"steps": steps, "alone": alone, "exit": _vector(model), "count": local_sgd.num_steps}


@pytest.mark.proc
def test_two_ranks_average_every_k_steps_and_on_leaving_the_block():
    from tests.distributed.dist_launch import launch

    r0, r1 = launch(_train, world_size=2)
    for step in range(K - 1):  # no gradient sync: each rank moved as it would alone, and they differ
        for r in (r0, r1):
            assert torch.equal(r["steps"][step], r["alone"][step])
        assert not torch.equal(r0["steps"][step], r1["steps"][step])
    # the K-th step: both ranks hold the average of where each would be alone
    torch.testing.assert_close(r0["steps"][K - 1], (r0["alone"][K - 1] + r1["alone"][K - 1]) / 2)
    assert torch.equal(r0["steps"][K - 1], r1["steps"][K - 1])
    assert not torch.equal(r0["steps"][K], r1["steps"][K])  # apart again after the next step
    assert torch.equal(r0["exit"], r1["exit"])  # leaving the block averages once more
    torch.testing.assert_close(r0["exit"], (r0["steps"][K] + r1["steps"][K]) / 2)
    assert r0["count"] == r1["count"] == STEPS


def test_one_process_or_disabled_does_nothing_but_count():
    from mmvl.engine import Engine

    engine = Engine(device="cpu")
    model = _model()
    model, optimizer = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for enabled in (True, False):
        before = _vector(model)
        with LocalSGD(accelerator=engine, model=model, local_sgd_steps=1, enabled=enabled) as local_sgd:
            for _ in range(3):
                local_sgd.step()
        assert local_sgd.num_steps == 3 and not local_sgd.enabled
        assert torch.equal(_vector(model), before)
        assert "local_sgd" not in engine.checkpointables  # nothing added to the checkpoints


@pytest.mark.parametrize("steps", [0, -2, 1.5, True, "8"])
def test_local_sgd_steps_must_be_a_whole_number_of_1_or_more(steps):
    from mmvl.engine import Engine

    with pytest.raises(UserError, match=rf"LocalSGD\(local_sgd_steps={steps!r}\).*e\.g\. 8"):
        LocalSGD(accelerator=Engine(device="cpu"), model=_model(), local_sgd_steps=steps)


def _sharding() -> list[str]:
    import mmvl.distributed.strategies  # noqa: F401  (registers them)
    from mmvl.registry import STRATEGIES

    return [n for n in STRATEGIES.names() if getattr(STRATEGIES.get(n), "shards_optimizer_state", False)]


def test_the_sharding_strategies_are_known():
    assert {"fsdp", "zero_torch"} <= set(_sharding())


@pytest.mark.parametrize("name", _sharding())
def test_a_sharding_strategy_is_refused_in_one_line(name):
    """Strategies that shard parameters or their updates (the registry's shards_optimizer_state)."""
    engine = SimpleNamespace(strategy=SimpleNamespace(name=name, shards_optimizer_state=True), world_size=2)
    with pytest.raises(UserError, match=rf"distributed.strategy={name} shards them.*use distributed.strategy=ddp"):
        LocalSGD(accelerator=engine, model=_model(), local_sgd_steps=4)
