"""``split_between_processes``'s split (mmvl.engine.nested.split): each rank's contiguous part of a list,
a tensor, a dict of them, or a Hugging Face ``Dataset`` (whose slice would be a dict of columns)."""
from __future__ import annotations

import pytest
import torch

from mmvl.engine.nested import split


def test_lists_tensors_and_dicts_split_contiguously_first_ranks_taking_one_more():
    assert [split(list("abcde"), r, 2, False) for r in range(2)] == [list("abc"), list("de")]
    assert [split(list("abcde"), r, 2, True) for r in range(2)] == [list("abc"), list("dee")]
    parts = [split({"x": torch.arange(5)}, r, 2, False)["x"].tolist() for r in range(2)]
    assert parts == [[0, 1, 2], [3, 4]]


def test_a_hugging_face_dataset_splits_by_rows():
    datasets = pytest.importorskip("datasets")
    data = datasets.Dataset.from_list([{"k": v} for v in range(5)])
    parts = [split(data, r, 2, False) for r in range(2)]
    assert [p["k"] for p in parts] == [[0, 1, 2], [3, 4]]
    assert split(data, 1, 2, True)["k"] == [3, 4, 4]  # padded with the last row
