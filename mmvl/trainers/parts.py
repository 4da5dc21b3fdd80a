"""Building a run apart from running it: :func:`build_parts` turns a resolved config into the
parts the loop works with (:class:`RunParts`), and :class:`mmvl.trainers.Trainer` then holds the
loop (fit, the step, settle, evaluation) over them, as detectron2's ``DefaultTrainer`` builds what
its ``SimpleTrainer`` runs.

The order is the run's contract: rank 0 owns the save directory before any work; the model is
initialised under the same seed on every rank, its pretrained weights are loaded before the
Engine wraps it; randomness is per rank from the data on; the schedule's length is known only
once the training data is (``training.max_epochs``).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from mmvl.build import ModelSection, dataset_sections, datasets_from, filled_model_config, model_from
from mmvl.config.load import check_config_file
from mmvl.config import schema
from mmvl.config.schema import stages
from mmvl.data.loaders import resolve_pin_memory
from mmvl.data.predictions import check_prediction_targets
from mmvl.data.sample import DevicePrefetcher
from mmvl.data.shard_stream import train_stream
from mmvl.distributed.env import DistEnv
from mmvl.engine import Engine
from mmvl.engine.sections import EngineSections
from mmvl.engine.prepared import inner
from mmvl.errors import UserError
from mmvl.locks import lock_dir
from mmvl.losses import build_losses
from mmvl.metrics import build_metrics
from mmvl.optim import build_optimizer, build_scheduler, optimizer_section, scheduler_section
from mmvl.optim.footprint import footprint_line
from mmvl.trainers.contrastive_step import uses_cached_contrast
from mmvl.trainers.evaluation import Evaluator, prepare_split
from mmvl.trainers.resume import load_pretrained
from mmvl.utils.logger import setup_logging
from mmvl.utils.rng import seed_everything

log = logging.getLogger("mmvl")


@dataclasses.dataclass(frozen=True)
class RunSections:
    """Every section :func:`build_parts` hands out, resolved once from the loaded config: each
    builder is called with its own."""

    #: the model's name and ``model_config.<model>`` (a run without a model stops here)
    model: ModelSection
    #: ``dataset_config.<name>`` of each chosen dataset, in the order chosen
    datasets: dict[str, Any]
    training: schema.Training
    evaluation: schema.Evaluation
    multitasking: Any
    env: schema.Env
    engine: EngineSections
    stages: frozenset[str]

    @classmethod
    def of(cls, config: Any) -> "RunSections":
        model = ModelSection.of(config)  # before the datasets: a run without a model says so first
        return cls(model=model, datasets=dataset_sections(config), training=schema.section(config, "training"),
                   evaluation=schema.section(config, "evaluation"), multitasking=config.get("multitasking"),
                   env=schema.section(config, "env"), engine=EngineSections.of(config), stages=stages(config))


@dataclasses.dataclass
class RunParts:
    """What a run is made of, built from its config before the loop starts."""

    env: DistEnv
    engine: Engine
    #: this rank's share of ``training.batch_size``
    batch_size: int
    #: dataset builders by name (``datasets``)
    builders: dict[str, Any]
    #: prepared by the Engine (wrapped for its strategy), pretrained weights loaded
    model: torch.nn.Module
    optimizer: Any
    scheduler: Any | None
    #: ``(name, loss)`` pairs from the model's ``losses``
    losses: list[tuple[str, Any]]
    #: whether an update computes its contrastive loss over all its micro-batches at once
    cached_contrast: bool
    #: metrics by dataset name
    metrics: dict[str, Any]
    #: the run's one evaluator (built over the prepared model; its checks made)
    evaluator: Evaluator
    #: the endless training stream (None when the run does not train)
    train_data: Any | None
    #: the run's length in updates (from ``training.max_epochs`` when set)
    max_updates: int


def build_parts(config: Any, env: DistEnv | None = None) -> RunParts:
    """Every part of the run ``config`` describes (every rank calls it; ``env``: an initialised
    process group, else :func:`mmvl.distributed.init.init_distributed` makes one)."""
    from mmvl.distributed.init import init_distributed

    env = env or init_distributed(config)
    Engine.on_main_agreed(functools.partial(own_save_dir, config), "own env.save_dir")
    run = RunSections.of(config)
    t = run.training
    setup_logging(str(run.env.save_dir), env.rank, bool(t.colored_logs))
    seed_everything(int(t.seed))  # identical model initialisation on every rank
    engine = Engine(sections=run.engine, env=env)
    if int(t.batch_size) % env.world_size:
        raise UserError(f"training.batch_size={t.batch_size} is not divisible by the world size "
                        f"{env.world_size}; use a multiple of {env.world_size}.")
    batch_size = int(t.batch_size) // env.world_size
    check_packing(t)
    builders = datasets_from(run.datasets, run.env)
    prepare_data(engine, builders, run.stages)
    model = model_from(run.model, builders, bool(t.gradient_checkpointing),
                       checkpointing=not engine.strategy.handles_gradient_checkpointing)
    check_packing(t, model, run.model.name)
    load_pretrained(engine, model, config.checkpoint)  # checkpoint.resume_pretrained: weights only, before wrapping
    losses = build_losses(list(filled_model_config(run.model, builders).get("losses") or []))
    optimizer = build_optimizer(model, optimizer_section(config), env.device, batch_size=int(t.batch_size))
    model, optimizer = engine.prepare(model, optimizer)
    log.info(footprint_line(model, inner(optimizer)))  # after sharding: what each rank holds
    metrics = {name: build_metrics(list(b.config.get("metrics") or []) + list(run.evaluation.metrics or []))
               for name, b in builders.items()}
    evaluator = Evaluator(run.evaluation, t, str(run.env.save_dir), engine=engine, model=model, builders=builders,
                          metrics=metrics, losses=losses, batch_size=batch_size, model_name=run.model.name)
    seed_everything(int(t.seed), env.rank)  # per-rank randomness from here on
    train_data = training_stream(t, run.multitasking, engine, builders, batch_size) if "train" in run.stages else None
    max_updates = run_length(t, train_data, engine.gradient_accumulation)
    scheduler = build_scheduler(optimizer.optimizer, scheduler_section(config), max_updates)
    return RunParts(env=env, engine=engine, batch_size=batch_size, builders=builders, model=model,
                    optimizer=optimizer, scheduler=None if scheduler is None else engine.prepare(scheduler),
                    losses=losses, cached_contrast=uses_cached_contrast(losses, engine.gradient_accumulation),
                    metrics=metrics, evaluator=evaluator, train_data=train_data, max_updates=max_updates)


def own_save_dir(config: Any) -> None:
    """Rank 0 takes ``env.save_dir`` (run through :meth:`Engine.on_main_agreed`: every rank
    learns of a refusal, no rank waits for it): writable, locked for this process's life, no
    other run's config in it, prediction targets free; all before any work."""
    save_dir = str(config.env.save_dir)
    check_writable(save_dir)
    lock_dir(save_dir)  # one run per save dir, for this process's life
    check_config_file(os.path.join(save_dir, "config.yaml"))
    if schema.section(config, "evaluation").predict:  # before training, not after it
        check_prediction_targets(save_dir, [str(n) for n in config.datasets or []],
                                 [s for s in ("val", "test") if s in stages(config)])


def check_writable(save_dir: str) -> None:
    try:
        os.makedirs(save_dir, exist_ok=True)
        probe = os.path.join(save_dir, f".write_test_{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise UserError(f"env.save_dir={save_dir!r} is not writable ({e.strerror}); "
                        "choose another env.save_dir or fix its permissions.") from None


def prepare_data(engine: Engine, builders: Mapping[str, Any], run: frozenset[str]) -> None:
    """Rank 0 creates missing data first; the others wait, then only read."""
    if engine.is_main_process:
        for builder in builders.values():
            builder.prepare()
    engine.wait_for_everyone()
    if not engine.is_main_process:
        for builder in builders.values():
            builder.prepare()
    for builder in builders.values():  # every split the run will use, before any work on one
        for split in sorted(run):
            builder.check_split(split)
    for split in [s for s in ("train", "val", "test") if s in run]:  # every split the run uses, before any update,
        prepare_split(builders, split, engine.is_main_process)  # so a bad record stops it now (rank 0 caches)


def training_stream(training: schema.Training, multitasking: Any, engine: Engine, builders: Mapping[str, Any],
                    batch_size: int) -> Any:
    """This rank's endless stream of training batches over every dataset (a ShardStream for shard
    datasets; several datasets are sampled by ``multitasking``, its section as written), copied to
    the GPU ahead. ``training``: the typed section (seed, workers, pinning, length grouping)."""
    t, env = training, engine.env
    streams = {name: train_stream(
        b.build("train"), batch_size=batch_size, collate_fn=packer(b, name, t.packing_length) if t.packing else b.collate,
        seed=int(t.seed), rank=env.rank, world_size=env.world_size,
        num_workers=int(t.num_workers), pin_memory=resolve_pin_memory(t.pin_memory, env.device),
        persistent_workers=bool(t.persistent_workers), name=name, group_by_length=bool(t.group_by_length))
        for name, b in builders.items()}
    stream = next(iter(streams.values()))
    if len(streams) > 1:
        from mmvl.data.multi import MultiStream

        stream = MultiStream(streams, multitasking, seed=int(t.seed))
    if env.device.type == "cuda" and engine.prefetch:  # copy the next batch on a side stream
        stream = DevicePrefetcher(stream, env.device)
    return stream


def packer(builder: Any, name: str, length: int | None) -> Any:
    """``builder``'s collate of packed rows (``training.packing``), or a one-line refusal."""
    make = getattr(builder, "packer", None)
    if make is None:
        raise UserError(f"training.packing=true, but dataset {name!r} makes no token samples to pack (packing is for "
                        "generative datasets: a prompt_answer text processor); set training.packing=false.")
    return make(length)


def check_packing(training: schema.Training, model: Any = None, model_name: str = "") -> None:
    """``training.packing`` with what the run chose: not ``group_by_length`` (both answer padding: one
    by the rows, one by the order; checked before any data is prepared) and, once ``model`` is built,
    a model whose forward takes packed rows."""
    if not training.packing:
        return
    if training.group_by_length:
        raise UserError("training.packing=true with training.group_by_length=true: both cut padding (packing keeps the "
                        "random order, grouping changes it); set training.group_by_length=false.")
    if model is None:
        return
    if not getattr(model, "packs_samples", False):
        raise UserError(f"training.packing=true, but model {model_name} takes no packed rows; set "
                        "training.packing=false (packing runs on models vlm and hf_vlm).")
    why = model.packing_blocker() if hasattr(model, "packing_blocker") else None
    if why is not None:
        raise UserError(f"training.packing=true: {why}; set training.packing=false.")


def run_length(training: Any, train_data: Any | None, accumulation: int) -> int:
    """The run's length in updates: ``training.max_epochs`` over the training data when set, else
    ``training.max_updates``."""
    if training.max_epochs and train_data is not None:
        return max(1, int(train_data.batches_per_epoch / accumulation * float(training.max_epochs)))
    return int(training.max_updates)
