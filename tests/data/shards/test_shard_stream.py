"""Shards read through a DataLoader: every sample at most once per epoch, equal batch counts per rank,
a corrupt image skipped and counted, a missing shard one error naming it, and a resume from
``{epoch, batch}`` giving bitwise the batches of an uninterrupted stream (with workers and a shuffle buffer)."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import mmvl.data.datasets  # noqa: F401  (registers image_text_shards)
from mmvl.data.shard_stream import ShardStream, train_stream
from mmvl.data.shards import ShuffleOrder, count_samples, plan_epoch
from mmvl.errors import UserError
from mmvl.registry import DATASETS
from tests.fixtures.shard_data import write_pair_shards, write_vocab

ROOT = Path(__file__).resolve().parents[3]
pytest.importorskip("webdataset")


def builder(root: Path, pattern: str, buffer: int = 5, **extra):
    cfg = OmegaConf.load(ROOT / "configs/datasets/image_text_shards.yaml")
    cfg = OmegaConf.merge(cfg, {"dataset_config": {"image_text_shards": {
        "image_size": 16, "mask_probability": 0.3, "shuffle_buffer": buffer, **extra,
        "splits": {"train": {"shards": pattern}, "val": {"shards": "val-000000.tar"}},
        "processors": {"text_processor": {"params": {"tokenizer_path": str(write_vocab(root)),
                                                     "max_seq_length": 12}}}}}})
    return DATASETS.get("image_text_shards")(cfg.dataset_config.image_text_shards, str(root))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    info = write_pair_shards(root, n_samples=50, per_shard=6, corrupt=(7,))  # 8 shards of 6, one of 2
    write_pair_shards(root, n_samples=8, per_shard=8, prefix="val", first=100)
    return root, info


def stream(shards, workers: int = 0, rank: int = 0, world: int = 1, batch: int = 4, buffer: int = 5,
           seed: int = 3) -> ShardStream:
    root, info = shards
    b = builder(root, info["pattern"], buffer)
    return train_stream(b.build("train"), batch_size=batch, collate_fn=b.collate, seed=seed, rank=rank,
                        world_size=world, num_workers=workers)


def test_writer_counts_and_shuffle_order_is_a_permutation(shards):
    _, info = shards
    assert [count_samples(p, "t") for p in info["paths"]] == [6] * 8 + [2]
    for size in (1, 4, 100):
        order = list(ShuffleOrder(30, size, np.random.default_rng(0)))
        assert sorted(order) == list(range(30)) and (order == list(range(30))) == (size == 1)


@pytest.mark.proc
@pytest.mark.parametrize("workers", [0, 2])
def test_an_epoch_sees_each_sample_once_and_skips_the_corrupt_one(shards, workers, caplog):
    s = stream(shards, workers)
    plan = s.source.plan(0)
    assert s.batches_per_epoch == plan.per_rank == 12 and plan.dropped == 50 - 48
    with caplog.at_level(logging.INFO, logger="mmvl"):
        epoch = [next(s) for _ in range(s.batches_per_epoch)]
    ids = torch.cat([b["id"] for b in epoch]).tolist()
    assert len(ids) == len(set(ids)) == 47 and 7 not in ids  # 48 planned, the corrupt one skipped
    assert sorted(len(b["id"]) for b in epoch) == [3] + [4] * 11  # its batch is one smaller
    if workers == 0:  # the count is logged by the process that decoded it
        assert "skipped corrupt sample '000000007'" in caplog.text and "1 skipped so far" in caplog.text
    assert "2 of 50 samples dropped" in caplog.text
    assert set(torch.cat([b["targets"] for b in epoch]).tolist()) == {0, 1}
    assert all((b["lm_label_ids"] != -100).any() for b in epoch)
    nxt = torch.cat([next(s)["id"] for _ in range(3)]).tolist()
    assert s.epoch == 1 and nxt != ids[:len(nxt)]  # a new epoch, another order


@pytest.mark.parametrize("counts", [[6] * 8 + [2], [5] * 12 + [1], [7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 3]])
def test_ranks_and_workers_split_the_shards_without_overlap_and_equal_batches_every_epoch(counts):
    plans = {(e, r): plan_epoch(counts, seed=5, epoch=e, rank=r, world_size=2, workers=2, batch_size=3)
             for e in range(6) for r in range(2)}
    for epoch in range(6):
        pair = [plans[epoch, r] for r in range(2)]
        shards = [s for p in pair for w in p.shards for s in w]
        assert sorted(shards) == list(range(len(counts)))
        assert pair[0].per_rank == pair[1].per_rank and sum(pair[0].batches) == pair[0].per_rank
        assert pair[0].dropped == sum(counts) - 2 * 3 * pair[0].per_rank
        # the batch counts are the same every epoch (a consumer counts batches_per_epoch per epoch) ...
        assert [p.batches for p in pair] == [plans[0, r].batches for r in range(2)]
    # ... while the shards go to other readers
    assert len({tuple(map(tuple, plans[e, 0].shards)) for e in range(6)}) > 1


@pytest.mark.proc
def test_the_plan_ignores_the_global_rngs_a_rank_was_seeded_with(shards):
    """The Trainer seeds each rank with seed + rank before building its stream; the plan and each
    worker's shuffle must not notice, and reading ``batches_per_epoch`` batches per epoch on each rank
    (as the Trainer and the 2-rank test do) stays inside that epoch."""
    from mmvl.utils.rng import seed_everything

    seen = []
    for rank in range(2):
        seed_everything(11, rank)
        seen.append(plan_epoch([6] * 8 + [2], seed=3, epoch=1, rank=0, world_size=2, workers=2, batch_size=4))
    assert seen[0] == seen[1]
    epochs = []
    for rank in range(2):  # two ranks in one process, each after its own global seeding, two workers each
        seed_everything(11, rank)
        s = stream(shards, 2, rank=rank, world=2, batch=3, seed=1)  # a round robin split: 6 then 8 batches
        epochs.append([torch.cat([next(s)["id"] for _ in range(s.batches_per_epoch)]).tolist() for _ in range(2)])
    for epoch in range(2):
        ids = epochs[0][epoch] + epochs[1][epoch]
        assert len(ids) == len(set(ids)) and len(ids) >= 50 - 1 - 2 * 2 * 3  # the corrupt one, the remainder


@pytest.mark.proc
@pytest.mark.parametrize("workers,stop", [(0, 5), (2, 7), (2, 14)])
def test_resume_from_state_is_bitwise_the_uninterrupted_stream(shards, workers, stop):
    reference = stream(shards, workers)
    want = [next(reference) for _ in range(16)]  # into the second epoch
    first = stream(shards, workers)
    got = [next(first) for _ in range(stop)]
    state = first.state_dict()
    assert state["epoch"] == stop // 12 and state["batch"] == stop % 12
    resumed = stream(shards, workers)
    resumed.load_state_dict(state)
    got += [next(resumed) for _ in range(16 - stop)]
    for a, b in zip(want, got):
        assert a.keys() == b.keys()  # tensors, and collate's 'padded' flag
        assert all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def test_layout_change_on_resume_and_too_few_samples_are_user_errors(shards):
    state = stream(shards, 0).state_dict()
    with pytest.raises(UserError, match="workers 1 -> 2"):
        stream(shards, 2).load_state_dict(state)
    with pytest.raises(UserError, match="fewer samples than one batch"):
        stream(shards, 0, batch=64)
    with pytest.raises(UserError, match="9 shards cannot feed 10 ranks"):
        stream(shards, 0, world=10)


def test_missing_shard_names_it(shards):
    root, info = shards
    b = builder(root, "train-{000000..000011}.tar")
    with pytest.raises(UserError, match=r"shard '.*train-000009\.tar' does not exist \(3 of 12"):
        b.prepare_split("train")


def test_val_split_reads_by_offset_with_fixed_negatives(shards):
    root, info = shards
    val = builder(root, info["pattern"]).build("val")
    items = [val[i] for i in range(len(val))]
    assert len(val) == 8 and [i["id"] for i in items] == list(range(8))
    assert "lm_label_ids" not in items[0] and {i["targets"] for i in items} == {0, 1}
    assert all(torch.equal(a["input_ids"], val[k]["input_ids"]) for k, a in enumerate(items))
