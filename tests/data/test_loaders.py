"""TrainStream: one DataLoader (and, with persistent workers, the same workers) for every epoch,
a new order each epoch, and an exact mid-epoch resume; ``training.pin_memory: auto``; workers do
not copy the main process's Python heap when they collect garbage."""
from __future__ import annotations

import gc
import os
import re
import sys

import pytest
import torch

from mmvl.data.loaders import TrainStream, eval_loader, resolve_pin_memory
from mmvl.data.sample import collate
from mmvl.errors import UserError

N, BATCH = 24, 4  # 6 batches an epoch


class Items(torch.utils.data.Dataset):
    """Items that say which sample they are and which process made them."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict:
        return {"i": i, "pid": os.getpid()}


class EpochItems(Items):
    """Per-epoch sample randomness, as coco_captions' masking has: items report the epoch they saw."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __getitem__(self, i: int) -> dict:
        return {**super().__getitem__(i), "epoch": self.epoch}


def _stream(dataset=None, workers: int = 0, persistent: bool = False) -> TrainStream:
    return TrainStream(dataset or Items(), batch_size=BATCH, collate_fn=collate, seed=3, rank=0, world_size=1,
                       num_workers=workers, persistent_workers=persistent, name="items")


def _take(stream: TrainStream, n: int) -> list[dict]:
    return [next(stream) for _ in range(n)]


def _order(batches: list[dict]) -> list[int]:
    return [i for b in batches for i in b["i"].tolist()]


@pytest.mark.proc
@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)])
def test_one_loader_every_epoch_reshuffled_and_resumable(workers, persistent):
    stream = _stream(workers=workers, persistent=persistent)
    loader = stream.loader
    assert loader.persistent_workers is persistent
    batches = _take(stream, 13)  # two epochs and one batch into the third
    assert stream.loader is loader and stream.state_dict() == {"epoch": 2, "batch": 1}
    epochs = [_order(batches[0:6]), _order(batches[6:12])]
    assert all(sorted(e) == list(range(N)) for e in epochs) and epochs[0] != epochs[1]
    if persistent:  # the same two workers served every epoch
        assert len({pid for b in batches for pid in b["pid"].tolist()}) == 2
    state = stream.state_dict()
    expected = _order(_take(stream, 8))  # the rest of epoch 2 and into epoch 3
    resumed = _stream(workers=workers, persistent=persistent)
    resumed.load_state_dict(state)
    assert _order(_take(resumed, 8)) == expected
    assert _order(_take(_stream(), 6)) == epochs[0]  # the order is the seed's, whatever the workers


@pytest.mark.proc
def test_persistent_workers_see_each_epoch():
    """Persistent workers were started with the dataset of epoch 0; the epoch reaches them with the indices."""
    stream = _stream(EpochItems(), workers=2, persistent=True)
    batches = _take(stream, 14)
    assert [int(b["epoch"][0]) for b in batches] == [0] * 6 + [1] * 6 + [2] * 2
    assert all(len(set(b["epoch"].tolist())) == 1 for b in batches)
    resumed = _stream(EpochItems(), workers=2, persistent=True)
    resumed.load_state_dict({"epoch": 1, "batch": 4})
    assert [int(b["epoch"][0]) for b in _take(resumed, 3)] == [1, 1, 2]


@pytest.mark.parametrize("value,device,want", [("auto", "cuda", True), ("auto", "cpu", False),
                                               (True, "cpu", True), (False, "cuda", False)])
def test_pin_memory_auto_pins_for_cuda(value, device, want):
    assert resolve_pin_memory(value, torch.device(device)) is want


def test_pin_memory_rejects_other_values():
    with pytest.raises(UserError, match="training.pin_memory='yes' is not one of auto, true, false"):
        resolve_pin_memory("yes", torch.device("cpu"))


def test_trainer_reads_the_loader_keys(tmp_path):
    from mmvl.config import load_config
    from mmvl.trainers import Trainer
    from tests.fixtures.toy import register, toy_opts

    register()
    for persistent in (True, False):
        trainer = Trainer(load_config(toy_opts(tmp_path / str(persistent), "training.num_workers=1",
                                               f"training.persistent_workers={str(persistent).lower()}")))
        assert trainer.train_data.loader.persistent_workers is persistent
        assert trainer.train_data.loader.pin_memory is False  # auto, on the CPU
    with pytest.raises(UserError, match="training.group_by_length=true, but dataset 'toy' declares no sample lengths"):
        Trainer(load_config(toy_opts(tmp_path / "grouped", "training.group_by_length=true")))


def _private_dirty_kb() -> int:
    text = open("/proc/self/smaps_rollup").read()
    return int(re.search(r"^Private_Dirty:\s+(\d+)", text, re.M).group(1))


class FullCollection(torch.utils.data.Dataset):
    """Each item runs a full garbage collection in the worker and reports how many KB it copied."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict:
        before = _private_dirty_kb()
        gc.collect()
        return {"copied_kb": _private_dirty_kb() - before, "id": i}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps_rollup")
@pytest.mark.slow  # worker processes and a large collection
def test_a_worker_collection_copies_nothing_inherited():
    keep = [{"x": [i]} for i in range(200_000)]  # a main-process heap of a few tens of MB
    stream = TrainStream(FullCollection(), batch_size=2, collate_fn=collate, seed=0, rank=0, world_size=1,
                         num_workers=1)
    copied = [int(c) for _ in range(4) for c in next(stream)["copied_kb"]]
    copied += [int(c) for b in eval_loader(FullCollection(), batch_size=2, collate_fn=collate, rank=0,
                                           world_size=1, num_workers=1) for c in b["copied_kb"]]
    assert max(copied) < 2048, copied  # without gc.freeze the first collection copies > 20 MB
    assert len(keep) == 200_000


class Sized(Items):
    """Items of declared lengths (``training.group_by_length``), sample i of length LENGTHS[i]."""

    def __init__(self, n: int = 400) -> None:
        self.lengths = torch.randint(1, 200, (n,), generator=torch.Generator().manual_seed(0)).tolist()

    def __len__(self) -> int:
        return len(self.lengths)

    def sample_lengths(self) -> list[int]:
        return self.lengths


def _grouped(dataset, batch: int = BATCH, rank: int = 0, world: int = 1, group: bool = True) -> TrainStream:
    return TrainStream(dataset, batch_size=batch, collate_fn=collate, seed=3, rank=rank, world_size=world,
                       name="sized", group_by_length=group)


def test_group_by_length_pads_less_keeps_every_sample_and_resumes():
    data = Sized()
    padded = {}
    for group in (True, False):
        stream = _grouped(data, group=group)
        epoch = _take(stream, stream.batches_per_epoch)
        assert sorted(_order(epoch)) == sorted(_order(_take(_grouped(data, group=not group), stream.batches_per_epoch)))
        padded[group] = sum(BATCH * max(data.lengths[i] for i in b["i"].tolist()) for b in epoch)
        assert stream.state_dict() == {"epoch": 0, "batch": 100}
    # random batches pad to about the longest of 4 draws; sorted windows of 50 batches to about their own length
    assert padded[True] < 0.7 * padded[False]
    stream = _grouped(data)
    first, second = _order(_take(stream, 100)), _order(_take(stream, 100))
    assert first != second  # epochs regroup a new order (100 batches an epoch)
    state = {"epoch": 1, "batch": 37}
    resumed = _grouped(data)
    resumed.load_state_dict(state)
    assert _order(_take(resumed, 10)) == second[37 * BATCH: 47 * BATCH]
    lengths = [max(data.lengths[i] for i in second[k: k + BATCH]) for k in range(0, 100 * BATCH, BATCH)]
    assert lengths != sorted(lengths, reverse=True)  # the batches are shuffled, not longest first


def test_group_by_length_at_two_ranks_splits_the_one_process_batches():
    data = Sized()
    one = _take(_grouped(data, batch=2 * BATCH), 20)
    ranks = [_take(_grouped(data, rank=r, world=2), 20) for r in (0, 1)]
    for k in range(20):  # a global batch holds the same samples at world size 2 as at 1
        assert sorted(ranks[0][k]["i"].tolist() + ranks[1][k]["i"].tolist()) == sorted(one[k]["i"].tolist())


def test_group_by_length_needs_declared_lengths(tmp_path):
    with pytest.raises(UserError, match="dataset 'sized' declares no sample lengths; set training.group_by_length=false"):
        _grouped(Items())
    short = Sized()
    short.sample_lengths = lambda: short.lengths[:-1]  # one length short of the 400 samples
    with pytest.raises(UserError, match=r"dataset 'sized': sample_lengths\(\) gave \(399,\) lengths for 400 samples"):
        _grouped(short)
    from mmvl.data.shard_stream import ShardSource, train_stream

    source = ShardSource.__new__(ShardSource)  # only its type is read before the refusal
    with pytest.raises(UserError, match="dataset 'web' streams shards"):
        train_stream(source, batch_size=2, collate_fn=collate, seed=1, rank=0, world_size=1, name="web",
                     group_by_length=True)
