"""The Engine as Accelerate's Accelerator: keywords, prepare's loaders and autocast, state folders."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from mmvl.engine import Accelerator, DistributedType, Engine, find_executable_batch_size, set_seed
from mmvl.errors import UserError
from tests.distributed.dist_launch import launch


def _data(n: int = 20) -> TensorDataset:
    return TensorDataset(torch.arange(n), torch.randn(n, 4, generator=torch.Generator().manual_seed(n)))


def test_accelerator_is_the_engine_and_keywords_are_the_same_settings():
    assert Accelerator is Engine
    a = Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=3)
    assert (a.precision, a.mixed_precision, a.gradient_accumulation, a.device.type) == ("bf16", "bf16", 3, "cpu")
    assert a.distributed_type == DistributedType.NO and a.num_processes == 1 and a.process_index == 0
    a.gradient_accumulation_steps = 2
    assert a.gradient_accumulation == 2
    assert Engine(mixed_precision="no").precision == "fp32"


@pytest.mark.parametrize("kwargs, match", [
    (dict(precision="fp16", mixed_precision="bf16"), "one setting twice"),
    (dict(gradient_accumulation=2, gradient_accumulation_steps=4), "one setting twice"),
    (dict(log_with="tensorbord"), "unknown tracker .tensorbord.*tensorboard"),
    (dict(mixed_precision="fp8"), "fp8"),
])
def test_conflicting_or_unsupported_keywords_are_one_clear_error(kwargs, match):
    with pytest.raises(UserError, match=match):
        Engine(**kwargs)


def test_prepared_model_computes_in_bf16_inside_forward_with_fp32_outputs():
    engine = Accelerator(cpu=True, mixed_precision="bf16")
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    seen = []
    for layer in (model[0], model[2]):
        layer.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    model = engine.prepare(model)
    out = model(torch.randn(3, 4))
    assert seen == [torch.bfloat16, torch.bfloat16] and out.dtype == torch.float32
    fp32 = Accelerator(cpu=True).prepare(torch.nn.Linear(4, 2))
    assert fp32(torch.randn(3, 4)).dtype == torch.float32


def test_prepare_keeps_every_setting_of_the_users_loader():
    def init(worker_id):
        pass

    g = torch.Generator().manual_seed(7)
    loader = DataLoader(_data(), batch_size=4, shuffle=True, generator=g, num_workers=1, worker_init_fn=init,
                        persistent_workers=True, prefetch_factor=3, timeout=30, multiprocessing_context="spawn")
    prepared = Engine(cpu=True).prepare(loader).loader
    assert (prepared.worker_init_fn, prepared.persistent_workers, prepared.prefetch_factor, prepared.timeout) == \
        (init, True, 3, 30)
    assert prepared.multiprocessing_context.get_start_method() == "spawn"
    assert prepared.batch_sampler.batch_sampler.sampler is loader.sampler  # the user's sampler, sharded, not replaced


def _epochs(loader, n):
    return [torch.cat([b[0] for b in loader]).tolist() for _ in range(n)]


def test_each_epoch_is_a_new_order_from_the_users_generator_or_the_run_seed():
    set_seed(0)
    plain = _epochs(Engine(cpu=True).prepare(DataLoader(_data(), batch_size=4, shuffle=True)), 3)
    assert all(sorted(e) == list(range(20)) for e in plain) and len({tuple(e) for e in plain}) == 3
    set_seed(0)
    assert _epochs(Engine(cpu=True).prepare(DataLoader(_data(), batch_size=4, shuffle=True)), 3) == plain

    def seeded(seed):
        g = torch.Generator().manual_seed(seed)
        return _epochs(Engine(cpu=True).prepare(DataLoader(_data(), batch_size=4, shuffle=True, generator=g)), 2)

    assert seeded(1) == seeded(1) and seeded(1) != seeded(2)


def test_a_custom_batch_sampler_is_kept_and_its_batches_are_the_global_batches():
    batches = [[0, 1, 2], [3, 4, 5, 6], [7]]
    prepared = Engine(cpu=True).prepare(DataLoader(_data(8), batch_sampler=batches))
    assert [b[0].tolist() for b in prepared] == batches


def _train(engine, loader, model, opt, steps=None, stop_at=None, out=None):
    """A loop in Accelerate's shape with dropout; returns the batches' ids."""
    ids = []
    for _epoch in range(2):
        for i, (idx, x) in enumerate(loader):
            loss = model(x).pow(2).mean()
            engine.backward(loss)
            opt.step()
            opt.zero_grad()
            ids.append(idx.tolist())
            if stop_at is not None and len(ids) == stop_at:
                engine.save_state(out)
                return ids
    return ids


def _setup(seed=0):
    set_seed(seed)
    engine = Engine(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return engine, *engine.prepare(model, opt, DataLoader(_data(), batch_size=3, shuffle=True))


def test_killed_after_save_state_mid_epoch_and_resumed_is_bitwise_the_uninterrupted_run(tmp_path):
    engine, model, opt, loader = _setup()
    full = _train(engine, loader, model, opt)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    engine, model, opt, loader = _setup()
    first = _train(engine, loader, model, opt, stop_at=9, out=tmp_path / "step_9")  # epoch 1, batch 2
    engine, model, opt, loader = _setup(seed=123)  # another seed: the state brings the run's back
    engine.load_state(tmp_path / "step_9")
    rest = []
    for idx, x in engine.skip_first_batches(loader, 2):  # as checkpointing.py: skip the restored count
        engine.backward(model(x).pow(2).mean())
        opt.step()
        opt.zero_grad()
        rest.append(idx.tolist())
    assert first + rest == full
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k]), k


def test_skip_first_batches_starts_this_epoch_at_batch_n():
    loader = Engine(cpu=True).prepare(DataLoader(_data(12), batch_size=3))
    assert [b[0][0].item() for b in Engine(cpu=True).skip_first_batches(loader, 2)] == [6, 9]
    assert len(Engine(cpu=True).skip_first_batches(loader, 1)) == 3
    with pytest.raises(UserError, match="returned by prepare"):
        Engine(cpu=True).skip_first_batches(DataLoader(_data()), 1)


def test_register_for_checkpointing_and_state_folders(tmp_path):
    engine = Engine(cpu=True, project_dir=tmp_path)
    counter = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1),
                                                lambda s: 1.0)
    engine.register_for_checkpointing(counter)
    counter.step()
    path = engine.save_state()
    assert path.endswith("checkpoint_0") and engine.save_state().endswith("checkpoint_1")
    counter.step()
    engine.load_state()  # the latest
    assert counter.last_epoch == 1
    with pytest.raises(UserError, match="state_dict"):
        engine.register_for_checkpointing(object())
    with pytest.raises(UserError, match="complete save_state folder"):
        engine.load_state(tmp_path / "missing")


# ~14 s of retried batches: with the slow tests (fast-suite margin)
@pytest.mark.slow
def test_find_executable_batch_size_shrinks_by_accelerates_rule_after_out_of_memory():
    tried = []

    @find_executable_batch_size(starting_batch_size=20)
    def loop(batch_size, scale):
        tried.append(batch_size)
        if batch_size > 12:  # both forms Accelerate treats as out of memory
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if batch_size > 10:
            raise RuntimeError("CUDA out of memory.")
        return batch_size * scale

    assert loop(2) == 20 and tried == [20, 18, 16, 14, 12, 10]  # int(0.9 * b), positional arguments passed on
    with pytest.raises(UserError, match="given its batch size"):
        loop(8, 2)
    sizes = iter([32, 16])

    @find_executable_batch_size(starting_batch_size=64, reduce_batch_size_fn=lambda: next(sizes))
    def halving(batch_size):
        if batch_size > 16:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return batch_size

    assert halving() == 16
    with pytest.raises(ValueError):
        find_executable_batch_size(lambda b: (_ for _ in ()).throw(ValueError("out of memory")))()


def _two_ranks(env):
    engine = Engine(env=env)
    loader = engine.prepare(DataLoader(_data(10), batch_size=2, shuffle=True))
    epochs = [[b[0].tolist() for b in loader] for _ in range(2)]
    evaluation = engine.prepare(DataLoader(_data(7), batch_size=2))
    gathered = torch.cat([engine.gather_for_metrics(b[0]) for b in evaluation])
    if env.rank == 1:
        engine.set_trigger()
    triggered = engine.check_trigger()
    again = engine.check_trigger()
    return {"epochs": epochs, "gathered": gathered, "trigger": [triggered, again],
            "reduced": engine.reduce(torch.tensor([float(env.rank + 1)]), "mean"),
            "padded": engine.pad_across_processes(torch.ones(env.rank + 1)).shape[0]}


@pytest.mark.slow
def test_two_ranks_share_each_steps_batch_new_orders_uneven_gather_and_triggers():
    r0, r1 = launch(_two_ranks, world_size=2)
    for e in range(2):  # each step's batches, rank 0's then rank 1's, are the next 4 of the epoch's order
        order = [i for step in zip(r0["epochs"][e], r1["epochs"][e]) for batch in step for i in batch]
        assert sorted(order[:10]) == list(range(10)) and order[10:] == order[:2]  # 5 batches: the 6th repeats
    assert r0["epochs"][0] != r0["epochs"][1]
    assert r0["gathered"].tolist() == list(range(7)) == r1["gathered"].tolist()  # padding dropped
    assert r0["trigger"] == [True, False] == r1["trigger"]
    assert r0["reduced"].item() == 1.5 and r0["padded"] == 2 == r1["padded"]
