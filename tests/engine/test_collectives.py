"""The Engine's collective doors for trainers and callbacks, in one process (no process group): each
gives what mmvl.distributed.comm gives, and they work before any Engine exists (static)."""
from __future__ import annotations

import pytest
import torch

from mmvl.engine import Engine
from mmvl.errors import UserError


def test_collectives_in_one_process():
    assert Engine.gather_object({"rows": [1, 2]}) == [{"rows": [1, 2]}]
    means = Engine.reduce_dict({"b": torch.tensor(2.0), "a": torch.tensor(1)})
    assert {k: float(v) for k, v in means.items()} == {"a": 1.0, "b": 2.0}
    assert int(Engine.all_reduce(torch.tensor([3]), "min")) == 3
    assert Engine.async_max(5).result() == 5
    assert Engine.on_main_agreed(lambda: "made", "make it") == "made"
    Engine.all_ranks_agreed(None, "agree")  # nobody has a problem: nothing raised


def test_a_problem_on_rank_zero_or_any_rank_is_a_user_error():
    def refuse():
        raise UserError("env.save_dir='x' is not writable; choose another.")

    with pytest.raises(UserError, match="not writable"):
        Engine.on_main_agreed(refuse, "own the save dir")
    with pytest.raises(UserError, match="no such file"):
        Engine.all_ranks_agreed("no such file", "resume")
