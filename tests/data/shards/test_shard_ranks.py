"""Two ranks x two DataLoader workers (real gloo processes): per epoch every sample is seen at most once
over all ranks, and both ranks run the same number of batches."""
from __future__ import annotations

import pytest

from tests.data.shards.dist_shard_checks import epoch_ids
from tests.distributed.dist_launch import launch
from tests.fixtures.shard_data import write_pair_shards, write_vocab

pytest.importorskip("webdataset")


@pytest.mark.slow
def test_two_ranks_two_workers_at_most_once_equal_batches(tmp_path):
    info = write_pair_shards(tmp_path, n_samples=61, per_shard=5, size=8)  # 13 shards, the last of 1
    results = launch(epoch_ids, world_size=2, args=(str(tmp_path), info["pattern"], str(write_vocab(tmp_path))),
                     timeout=240)
    for epoch in range(2):
        per_rank = [results[r]["epochs"][epoch] for r in range(2)]
        assert len(per_rank[0]) == len(per_rank[1]) > 0
        ids = [i for batches in per_rank for b in batches for i in b]
        assert len(ids) == len(set(ids)) and set(ids) <= set(range(61)), per_rank
        assert 61 - len(ids) < 2 * 2 * 3 + 5  # only remainders are dropped (plus an uneven shard split)
    assert results[0]["epochs"][0] != results[0]["epochs"][1]
