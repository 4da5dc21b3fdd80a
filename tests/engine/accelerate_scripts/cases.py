"""The cases of Accelerate's own test scripts (``accelerate/test_utils/scripts/``), one per test
function call of each script's ``main()``, with the world sizes at which ``main()`` runs it on CPU.

A case is ``(script, name, call)``: ``call(module, accelerator)`` runs the test function of the
(possibly ported) script ``module``; ``accelerator`` is one ``module.Accelerator()`` (or the
script's ``create_accelerator()``) made before each case, as ``main()`` makes it first.
``EXTRA`` cases are ones ``main()`` runs on GPUs only; they run here at 2 processes too, since their
meaning (split batches, ``sync_each_batch``) does not need a GPU.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable

SCRIPTS = {"script": "accelerate.test_utils.scripts.test_script",
           "sync": "accelerate.test_utils.scripts.test_sync",
           "data_loop": "accelerate.test_utils.scripts.test_distributed_data_loop"}


@dataclass(frozen=True)
class Case:
    script: str
    name: str
    call: Callable[[Any, Any], Any]
    worlds: tuple[int, ...] = (1, 2)
    extra: bool = False

    @property
    def id(self) -> str:
        return f"{self.script}:{self.name}"


def _fn(name: str, *args: Any) -> Callable[[Any, Any], Any]:
    return lambda m, acc: getattr(m, name)(*args)


def _with_acc(name: str) -> Callable[[Any, Any], Any]:
    return lambda m, acc: getattr(m, name)(acc)


def _split_dataset(m: Any, acc: Any) -> None:
    from datasets import Dataset  # main() skips the case without it; here it fails with both

    m.test_split_between_processes_dataset(Dataset)


def _non_ddp_warning(m: Any, acc: Any) -> None:
    """As main(): the state claims FSDP while the check runs."""
    original = acc.state.distributed_type
    acc.state.distributed_type = m.DistributedType.FSDP
    try:
        m.test_join_raises_warning_for_non_ddp_distributed(acc)
    finally:
        acc.state.distributed_type = original


def _data_loader(kind: str) -> Callable[[Any, Any], Any]:
    def run(m: Any, acc: Any) -> None:
        from torch.utils.data import BatchSampler, DataLoader, RandomSampler, default_collate

        dataset = m.DummyDataset()
        if kind in ("shuffle_false", "shuffle_true"):
            loader = DataLoader(dataset, shuffle=kind == "shuffle_true", batch_size=m.BATCH_SIZE,
                                num_workers=m.NUM_WORKERS)
        elif kind == "batch_sampler":
            sampler = BatchSampler(RandomSampler(dataset), batch_size=m.BATCH_SIZE, drop_last=False)
            loader = DataLoader(dataset, batch_sampler=sampler, num_workers=m.NUM_WORKERS)
        else:  # a BatchSampler given as the sampler, batch_size=None
            sampler = BatchSampler(RandomSampler(dataset), batch_size=m.BATCH_SIZE, drop_last=False)
            loader = DataLoader(dataset, sampler=sampler, batch_size=None, collate_fn=default_collate,
                                num_workers=m.NUM_WORKERS)
        m.test_data_loader(loader, acc)
    return run


SCRIPT_CASES = [
    Case("script", "init_state_check", _fn("init_state_check")),
    Case("script", "process_execution_check", _fn("process_execution_check")),
    *[Case("script", f"test_split_between_processes_{k}", _fn(f"test_split_between_processes_{k}"))
      for k in ("list", "tuple", "nested_dict", "tensor", "evenly")],
    Case("script", "test_split_between_processes_dataset", _split_dataset),
    Case("script", "rng_sync_check", _fn("rng_sync_check")),
    Case("script", "dl_preparation_check", _fn("dl_preparation_check")),
    Case("script", "central_dl_preparation_check", _fn("central_dl_preparation_check")),
    Case("script", "custom_sampler_check", _fn("custom_sampler_check")),
    Case("script", "check_seedable_sampler", _fn("check_seedable_sampler")),
    Case("script", "check_seedable_sampler_with_data_seed", _fn("check_seedable_sampler_with_data_seed")),
    Case("script", "check_seedable_sampler_in_batch_sampler_shard",
         _fn("check_seedable_sampler_in_batch_sampler_shard"), worlds=(2,)),
    Case("script", "training_check(use_seedable_sampler=False)", _fn("training_check", False)),
    Case("script", "training_check(use_seedable_sampler=True)", _fn("training_check", True)),
    Case("script", "test_trigger", _fn("test_trigger")),
    Case("script", "test_reinstantiated_state", _fn("test_reinstantiated_state")),
]

SYNC_CASES = [
    Case("sync", "test_dataloader_break", _fn("test_dataloader_break")),
    Case("sync", "test_noop_sync", _with_acc("test_noop_sync"), worlds=(1,)),
    Case("sync", "test_distributed_sync", _with_acc("test_distributed_sync"), worlds=(2,)),
    Case("sync", "test_distributed_sync_multiple_fwd", _with_acc("test_distributed_sync_multiple_fwd"),
         worlds=(2,)),
    Case("sync", "test_gradient_accumulation_with_opt_and_scheduler()",
         _fn("test_gradient_accumulation_with_opt_and_scheduler")),
    *[Case("sync", f"test_gradient_accumulation(split={s}, dispatch={d}, sync_each={e})",
           _fn("test_gradient_accumulation", s, d, e), worlds=(2,), extra=True)
      for s, d, e in itertools.product((True, False), repeat=3)],
    *[Case("sync", f"test_gradient_accumulation_with_opt_and_scheduler(split={s}, dispatch={d}, sync_each={e})",
           _fn("test_gradient_accumulation_with_opt_and_scheduler", s, d, e), worlds=(2,), extra=True)
      for s, d, e in itertools.product((True, False), repeat=3) if s or d or e],
]

_LOOP = dict(worlds=(2,))  # create_accelerator() asserts two processes
DATA_LOOP_CASES = [
    Case("data_loop", "test_skip_first_batches_preserves_metric_samples",
         _with_acc("test_skip_first_batches_preserves_metric_samples"), **_LOOP),
    *[Case("data_loop", n, _fn(n), worlds=(2,)) for n in (
        "test_default_ensures_even_batch_sizes", "test_can_disable_even_batches", "test_can_join_uneven_inputs",
        "test_join_can_override_even_batches", "test_join_can_override_for_mixed_type_dataloaders",
        "test_join_raises_warning_for_iterable_when_overriding_even_batches")],
    Case("data_loop", "test_join_raises_warning_for_non_ddp_distributed", _non_ddp_warning, **_LOOP),
    Case("data_loop", "test_pickle_accelerator", _fn("test_pickle_accelerator"), worlds=(2,)),
    *[Case("data_loop", f"test_data_loader({k})", _data_loader(k), **_LOOP)
      for k in ("shuffle_false", "shuffle_true", "batch_sampler", "sampler_is_batch_sampler")],
    Case("data_loop", "test_stateful_dataloader", _with_acc("test_stateful_dataloader"), **_LOOP),
    Case("data_loop", "test_stateful_dataloader_save_state", _with_acc("test_stateful_dataloader_save_state"),
         **_LOOP),
]

CASES = {c.id: c for c in SCRIPT_CASES + SYNC_CASES + DATA_LOOP_CASES}


def cases_at(world: int, extra: bool = True) -> list[Case]:
    return [c for c in CASES.values() if world in c.worlds and (extra or not c.extra)]
