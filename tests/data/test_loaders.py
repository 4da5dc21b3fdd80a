"""DataLoader workers do not copy the main process's Python heap when they collect garbage."""
from __future__ import annotations

import gc
import re
import sys

import pytest
import torch
from torch.utils.data import Dataset

from mmvl.data.loaders import TrainStream, eval_loader
from mmvl.data.sample import collate

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps_rollup")


def _private_dirty_kb() -> int:
    text = open("/proc/self/smaps_rollup").read()
    return int(re.search(r"^Private_Dirty:\s+(\d+)", text, re.M).group(1))


class FullCollection(Dataset):
    """Each item runs a full garbage collection in the worker and reports how many KB it copied."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict:
        before = _private_dirty_kb()
        gc.collect()
        return {"copied_kb": _private_dirty_kb() - before, "id": i}


def test_a_worker_collection_copies_nothing_inherited():
    keep = [{"x": [i]} for i in range(200_000)]  # a main-process heap of a few tens of MB
    stream = TrainStream(FullCollection(), batch_size=2, collate_fn=collate, seed=0, rank=0, world_size=1,
                         num_workers=1)
    copied = [int(c) for _ in range(4) for c in next(stream)["copied_kb"]]
    copied += [int(c) for b in eval_loader(FullCollection(), batch_size=2, collate_fn=collate, rank=0,
                                           world_size=1, num_workers=1) for c in b["copied_kb"]]
    assert max(copied) < 2048, copied  # without gc.freeze the first collection copies > 20 MB
    assert len(keep) == 200_000
