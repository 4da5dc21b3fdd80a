"""graph_breaks: nothing for a function Dynamo captures whole, each distinct reason (with what broke)
otherwise, and an earlier compile of the same code does not hide its breaks."""
from __future__ import annotations

import torch

from mmvl.utils.compile import graph_breaks


def _whole(x: torch.Tensor) -> torch.Tensor:
    return (x * 2).relu().sum()


def _reads_back(x: torch.Tensor) -> torch.Tensor:
    if x.sum() > 0:  # a branch on a tensor's value: Dynamo must run Python here
        x = x * 2
    return x.sum()


def test_graph_breaks_names_each_reason_once():
    x = torch.ones(3)
    assert graph_breaks(_whole, x) == []
    breaks = graph_breaks(_reads_back, x)
    assert len(breaks) == 1 and "data-dependent" in breaks[0].lower(), breaks
    torch.compile(_reads_back, backend="eager")(x)  # compiled (and cached) already
    assert graph_breaks(_reads_back, x) == breaks
    torch._dynamo.reset()
