"""prepare() on an IterableDataset (each rank its own contiguous part of each group of the stream) and
accumulate() syncing on the epoch's last batch, as Accelerate's GradientState does."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from mmvl.engine import Accelerator
from tests.distributed.dist_launch import launch


class Stream(IterableDataset):
    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return iter(torch.arange(self.n))


def _sync_pattern(accelerator, loader, model, optimizer, epochs=2):
    pattern = []
    for _ in range(epochs):
        epoch = []
        for batch in loader:
            x = batch[0] if isinstance(batch, (list, tuple)) else batch
            before = accelerator.unwrap_model(model).weight.detach().clone()
            with accelerator.accumulate(model):
                accelerator.backward(model(x.float().reshape(-1, 1)).sum())
                optimizer.step()
                optimizer.zero_grad()
            epoch.append((accelerator.sync_gradients, not torch.equal(before, accelerator.unwrap_model(model).weight)))
        pattern.append(epoch)
    return pattern


def test_accumulate_syncs_and_steps_on_the_epochs_last_batch_and_restarts_the_count():
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    model = torch.nn.Linear(1, 1)
    model, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                   DataLoader(TensorDataset(torch.arange(10)), batch_size=2))
    # 5 batches: the 4th closes a group, the 5th (a group of one) is the epoch's last and steps too
    expected = [(False, False)] * 3 + [(True, True)] * 2
    assert _sync_pattern(accelerator, loader, model, optimizer) == [expected, expected]


def _two_ranks_stream(env):
    accelerator = Accelerator(env=env, gradient_accumulation_steps=2)
    model = torch.nn.Linear(1, 1)
    model, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                   DataLoader(Stream(11), batch_size=2))
    mine = [[b.tolist() for b in loader] for _ in range(2)]
    gathered = []
    for batch in loader:
        gathered += accelerator.gather_for_metrics(batch).tolist()
    return {"mine": mine, "gathered": gathered, "sync": _sync_pattern(accelerator, loader, model, optimizer, 1)}


@pytest.mark.slow
def test_an_iterable_dataset_is_sharded_by_rank_and_gathers_every_item_once():
    r0, r1 = launch(_two_ranks_stream, world_size=2)
    # each group of 2x2 items: rank 0 the first 2, rank 1 the next; the last partial group [8, 9, 10]
    # is filled from the stream's start
    assert r0["mine"] == [[[0, 1], [4, 5], [8, 9]]] * 2 and r1["mine"] == [[[2, 3], [6, 7], [10, 0]]] * 2
    assert sorted(r0["gathered"]) == list(range(11)) == sorted(r1["gathered"])  # the padding dropped
    assert r0["sync"] == r1["sync"] == [[(False, False), (True, True), (True, True)]]  # 3 batches: 2 and the last
