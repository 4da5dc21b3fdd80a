"""Accelerate's sharding of a prepared loader (mmvl.engine.shards) and its configuration objects,
in one process: the layout is a pure function of the epoch's batches, rank and world size."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.data import DataLoader

from mmvl.engine import (Accelerator, DataLoaderConfiguration, GradientAccumulationPlugin, SeedableRandomSampler,
                         prepare_data_loader)
from mmvl.engine.nested import split
from mmvl.engine.shards import layout
from mmvl.errors import UserError


def _batches(n: int, size: int) -> list[list[int]]:
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def _ranks(n: int, size: int, world: int, split_batches: bool = False, even: bool = True):
    return [layout(_batches(n, size), size, r, world, split_batches, even) for r in range(world)]


def test_each_step_concatenated_over_ranks_is_the_next_global_chunk():
    ranks = _ranks(32, 4, 2)
    steps = [ranks[0][0][k] + ranks[1][0][k] for k in range(len(ranks[0][0]))]
    assert [i for s in steps for i in s] == list(range(32)) and all(len(s) == 8 for s in steps)
    split_ranks = _ranks(32, 8, 2, split_batches=True)
    assert split_ranks[0][0][0] == [0, 1, 2, 3] and split_ranks[1][0][0] == [4, 5, 6, 7]


@pytest.mark.parametrize("n, size, even, sizes0, sizes1", [
    (3, 1, True, [1, 1], [1, 1]), (7, 2, True, [2, 2], [2, 2]),  # Accelerate's own expectations
    (3, 1, False, [1, 1], [1]), (7, 2, False, [2, 2], [2, 1])])
def test_even_batches_fill_the_end_from_the_start(n, size, even, sizes0, sizes1):
    (b0, real0), (b1, _) = _ranks(n, size, 2, even=even)
    assert [len(b) for b in b0] == sizes0 and [len(b) for b in b1] == sizes1
    if even:  # the last step's real samples are counted (gather_for_metrics keeps those)
        assert real0[-1] == n - (len(b0) - 1) * 2 * size and b1[-1][-1] == 0


def test_one_process_keeps_the_loaders_batches_as_they_are():
    assert layout(_batches(7, 2), 2, 0, 1, False, True) == (_batches(7, 2), [None] * 4)


def test_split_batches_needs_a_batch_divisible_by_the_processes():
    with pytest.raises(UserError, match="multiple of 2"):
        prepare_data_loader(DataLoader(list(range(9)), batch_size=3), num_processes=2, process_index=0,
                            split_batches=True)


def test_prepare_data_loader_gives_this_ranks_whole_batches():
    loader = prepare_data_loader(DataLoader(list(range(16)), batch_size=4), num_processes=2, process_index=1)
    assert [b.tolist() for b in loader] == [[4, 5, 6, 7], [12, 13, 14, 15]] and len(loader) == 2


def test_a_users_generator_draws_the_order_a_plain_loader_draws():
    def epochs(prepare: bool) -> list[list[int]]:
        g = torch.Generator().manual_seed(42)
        loader = DataLoader(list(range(12)), batch_size=4, shuffle=True, generator=g)
        loader = Accelerator(cpu=True).prepare(loader) if prepare else loader
        return [torch.cat(list(loader)).tolist() for _ in range(3)]

    assert epochs(prepare=True) == epochs(prepare=False)


def test_seedable_sampler_orders_depend_on_epoch_and_data_seed_only():
    def run(data_seed: int, epochs: int = 2) -> list[list[int]]:
        config = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=data_seed)
        loader = Accelerator(cpu=True, dataloader_config=config).prepare(
            DataLoader(list(range(10)), batch_size=5, shuffle=True))
        first = [torch.cat(list(loader)).tolist() for _ in range(epochs)]
        loader.set_epoch(0)
        assert [torch.cat(list(loader)).tolist() for _ in range(epochs)] == first
        assert isinstance(loader.batch_sampler.batch_sampler.sampler, SeedableRandomSampler)
        return first

    assert run(1) == run(1) and run(1) != run(2) and run(1)[0] != run(1)[1]


def test_configuration_objects_are_read_by_their_fields():
    @dataclasses.dataclass
    class Foreign:  # Accelerate's classes, as far as mmvl can tell
        num_steps: int = 3
        sync_each_batch: bool = True

    engine = Accelerator(cpu=True, gradient_accumulation_plugin=Foreign(),
                         dataloader_config={"split_batches": True, "even_batches": False})
    assert engine.gradient_accumulation_steps == 3 and engine.gradient_state.sync_each_batch
    assert engine.dataloader_config.split_batches and not engine.dataloader_config.even_batches
    with pytest.raises(UserError, match="one setting twice"):
        Accelerator(cpu=True, gradient_accumulation_steps=2, gradient_accumulation_plugin=GradientAccumulationPlugin(4))
    with pytest.raises(UserError, match="unknown fields"):
        Accelerator(cpu=True, dataloader_config={"split_batch": True})


def test_gradient_state_follows_nested_loops_and_their_last_batches():
    engine = Accelerator(cpu=True)
    outer, inner = engine.prepare(DataLoader(list(range(6)), batch_size=2), DataLoader(list(range(4)), batch_size=2))
    state, seen = engine.gradient_state, []
    for i, _ in enumerate(outer):
        seen.append((state.active_dataloader is outer, state.end_of_dataloader))
        if i == 0:
            for _ in inner:
                seen.append((state.active_dataloader is inner, state.end_of_dataloader))
        if i == 1:
            break  # leaving a loop early ends its turn as the active loader
    assert seen == [(True, False), (True, False), (True, True), (True, False)]
    assert state.active_dataloader is None


def test_split_between_processes_keeps_the_type_and_pads_on_request():
    data = {"a": [1, 2, 3], "b": (4, 5, 6), "c": torch.arange(3)}
    parts = [split(data, r, 2, pad=True) for r in range(2)]
    assert parts[0]["a"] == [1, 2] and parts[1]["a"] == [3, 3] and parts[1]["b"] == (6, 6)
    assert parts[1]["c"].tolist() == [2, 2] and split([1, 2, 3], 1, 2, pad=False) == [3]


def test_gather_reduce_and_pad_keep_nested_shapes_in_one_process():
    engine = Accelerator(cpu=True)
    x, y = torch.ones(2, 3), torch.arange(2)
    gathered = engine.gather((x, {"y": y}))
    assert isinstance(gathered, tuple) and torch.equal(gathered[1]["y"], y)
    assert torch.equal(engine.reduce([x], "mean")[0], x) and engine.pad_across_processes({"y": y})["y"].shape == (2,)


def test_a_users_generator_resumes_mid_epoch_exactly(tmp_path):
    def setup(seed: int):
        engine = Accelerator(cpu=True)
        loader = DataLoader(list(range(12)), batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(seed))
        return engine, engine.prepare(loader)

    engine, loader = setup(7)
    whole = [b.tolist() for _ in range(3) for b in loader]
    engine, loader = setup(7)
    first = []
    for epoch in range(2):
        for b in loader:
            first.append(b.tolist())
            if len(first) == 6:  # epoch 1, batch 2
                engine.save_state(tmp_path / "mid")
                break
    engine, loader = setup(99)  # another generator seed: the state brings the run's back
    engine.load_state(tmp_path / "mid")
    rest = [b.tolist() for b in loader] + [b.tolist() for b in loader]
    assert first + rest == whole


def test_the_docs_member_table_names_every_public_member_of_accelerates_accelerator():
    """Read from Accelerate's source (not imported: fast), so a new Accelerate member shows up here."""
    import ast
    import importlib.util
    import re
    from pathlib import Path

    source = Path(importlib.util.find_spec("accelerate").origin).parent / "accelerator.py"
    tree = ast.parse(source.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Accelerator")
    members = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
               and not n.name.startswith("_")}
    docs = (Path(__file__).resolve().parents[2] / "docs" / "engine.md").read_text()
    table = docs[docs.index("### Every `Accelerator` member"):]
    table = table[:table.index("\n\n", table.index("| member |"))]
    assert not sorted(members - set(re.findall(r"`([A-Za-z_]\w*)", table)))


def test_local_process_decorator_logging_dir_and_multi_device(tmp_path):
    engine = Accelerator(cpu=True, project_dir=str(tmp_path))
    assert engine.on_local_process(lambda: "ran", local_process_index=0)() == "ran"
    assert engine.on_local_process(local_process_index=1)(lambda: "ran")() is None
    assert engine.logging_dir == str(tmp_path) and engine.multi_device is False
    assert engine.clear() == [] and engine.active_loader is None
