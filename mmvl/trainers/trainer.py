"""The training loop: batch -> forward -> loss -> backward -> step -> schedule.

Everything else (checkpoints, evaluation schedule, logging, early stop,
preemption, profiling) lives in callbacks; device, precision and parallelism
live in the Engine. Between two log intervals the step never waits for the
device: what must be read back (a non-finite loss, updates the fp16 scaler
skipped) is read in :meth:`Trainer.settle`, once per log interval and before
every checkpoint and evaluation.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from mmvl import registry
from mmvl.build import build_callbacks
from mmvl.checkpoint import CheckpointManager, State, schema
from mmvl.config import save_config
from mmvl.config.schema import stages, typed_section
from mmvl.distributed.env import DistEnv
from mmvl.losses import compute_losses
from mmvl.optim import base_lr
from mmvl.trainers.contrastive_step import cached_contrastive_update
from mmvl.trainers.evaluation import BestTracker
from mmvl.trainers.finite import NonFiniteGuard, NonFiniteLossError
from mmvl.trainers.parts import build_parts
from mmvl.trainers.resume import resume
from mmvl.trainers.state import HOOKS, LOG_HOOK, Best, Evaluation, Sections, TrainerState
from mmvl.utils.flops import FlopCount, batch_tokens, leaves_no_trace

log = logging.getLogger("mmvl")


@registry.register_trainer("mmvl")
class Trainer:
    """Trains and evaluates a run: the parts :func:`mmvl.trainers.parts.build_parts` builds from a
    resolved config, driven by fit, the step, settle and evaluation.

    It owns :attr:`state` (:class:`mmvl.trainers.state.TrainerState`), dispatches every hook of
    :data:`mmvl.trainers.state.HOOKS` to every callback itself, and is what callbacks see
    through :class:`mmvl.trainers.state.TrainerProtocol`. A callback saves through
    :meth:`save_checkpoint`, never through another callback. ``update``, ``epoch``,
    ``preempted``, ... are read-only views of :attr:`state` for scripts and tests.
    """

    def __init__(self, config: DictConfig, env: DistEnv | None = None,
                 checkpointables: Mapping[str, Any] | None = None):
        """Build the run's parts (:func:`mmvl.trainers.parts.build_parts`), then the loop's own state,
        callbacks and checkpointables, and resume. ``checkpointables``: more objects (name -> anything
        with ``state_dict``/``load_state_dict``) saved in every checkpoint and restored on resume,
        e.g. ``{"ema": ema}``."""
        self.config = config
        self.sections = Sections.of(config)  # what callbacks read of the config
        parts = build_parts(config, env)
        self.env, self.engine, self.batch_size, self.builders = parts.env, parts.engine, parts.batch_size, parts.builders
        self.model, self.optimizer, self.scheduler = parts.model, parts.optimizer, parts.scheduler
        self.losses, self.cached_contrast, self.metrics = parts.losses, parts.cached_contrast, parts.metrics
        self.train_data, self.evaluator = parts.train_data, parts.evaluator
        self.state = TrainerState(max_updates=parts.max_updates)
        t = self.sections.training
        self.clip_grad_norm = t.clip_grad_norm
        self.log_interval = max(1, int(t.log_interval or 1))
        self.flops = FlopCount()
        exit_on_nan = True if t.exit_on_nan is None else bool(t.exit_on_nan)
        self.nonfinite = NonFiniteGuard(self.engine.all_reduce, enabled=exit_on_nan
                                        and self.engine.precision != "fp16")  # fp16: the scaler skips them
        stop = t.early_stop
        self.best_tracker = BestTracker(stop.criteria, stop.minimize, {name for name, _ in self.losses})
        self._published: list[dict[str, Any]] = []  # on_log events waiting for the end of a hook's round
        self.checkpoints = CheckpointManager(str(self.sections.env.save_dir), int(self.sections.checkpoint.max_to_keep))
        keyed = build_callbacks(self.sections, self)  # training.builtin_callbacks, then training.callbacks
        self.callback_keys = [key for key, _ in keyed]  # their state's names in checkpoints
        self.callbacks = [callback for _, callback in keyed]
        self._register_checkpointables(checkpointables or {})
        self.resumed_from = resume(self)  # the checkpoint (file or sharded directory) or None
        self.state.epoch = self.epoch
        if self.env.is_main_process:  # only once everything was built: a failed start changes nothing
            save_config(config, os.path.join(str(self.sections.env.save_dir), "config.yaml"))

    @property
    def epoch(self) -> int:
        return self.train_data.epoch if self.train_data is not None else 0

    # read-only views of the state, for scripts and tests (callbacks read ``state``)
    update = property(lambda self: self.state.update)
    max_updates = property(lambda self: self.state.max_updates)
    preempted = property(lambda self: self.state.preempted)
    last_eval = property(lambda self: self.state.last_eval)
    last_saved = property(lambda self: self.state.last_saved)

    @property
    def should_stop(self) -> bool:
        return self.state.should_stop

    @should_stop.setter
    def should_stop(self, value: bool) -> None:  # callbacks written before TrainerState set it here
        self.state.should_stop = bool(value)

    # -- the loop -------------------------------------------------------------
    def fit(self) -> None:
        self.model.train()
        state = self.state
        self.dispatch("on_train_start")
        while state.update < state.max_updates and not state.should_stop:
            self.dispatch("on_update_start")
            info = self.train_step()
            state.update += 1
            state.epoch = self.epoch
            self.best_tracker.saw_losses(info["losses"])
            if state.update % self.log_interval == 0 or state.update >= state.max_updates:
                self.settle()
            self.dispatch("on_update_end", info)
        self.settle()
        self.dispatch("on_train_end")

    def train_step(self) -> dict[str, Any]:
        """One optimizer update over ``gradient_accumulation`` micro-batches (no wait on the device).

        The micro-batches stream: each is drawn after the previous one's backward, so device memory
        does not grow with the accumulation. Only an update that needs them together draws them all
        before the first forward (:meth:`_whole_update`); the first update also keeps them all, for
        its FLOP count after it (:meth:`count_flops`)."""
        engine = self.engine
        counted: list[Any] = []  # the first update's micro-batches as drawn, for count_flops after it

        def draw() -> Any:
            batch = engine.to_device(next(self.train_data))
            if self.flops.pending:
                counted.append(dict(batch) if isinstance(batch, Mapping) else batch)
            return batch

        if self.cached_contrast or any(hasattr(loss_fn, "begin_update") for _, loss_fn in self.losses):
            micro, tokens = self._whole_update([draw() for _ in range(engine.gradient_accumulation)])
        else:
            micro, tokens = [], 0
            for _ in range(engine.gradient_accumulation):
                batch = draw()
                micro.append(self._micro_step(batch))
                tokens += batch_tokens(batch)
                del batch  # before the next one is drawn: one micro-batch on the device at a time
        totals = mean_losses(micro)
        grad_norm = engine.clip_grad_norm_(self.model, self.clip_grad_norm) if self.clip_grad_norm else None
        self.nonfinite.record(totals, self.state.update + 1)
        lr = base_lr(self.optimizer)
        self.optimizer.step()
        self.optimizer.zero_grad()
        if self.scheduler is not None:
            self.scheduler.step()  # not for updates the fp16 scaler skipped
        for batch in counted:  # after the update: no strategy holds gradients in between now
            self.count_flops(batch)
        world = self.env.world_size
        return {"losses": totals, "grad_norm": grad_norm, "lr": lr, "tokens": tokens * world,
                "samples": self.batch_size * engine.gradient_accumulation * world}

    def _whole_update(self, batches: list[Any]) -> tuple[list[dict[str, torch.Tensor]], int]:
        """Forward and backward of an update whose micro-batches were all drawn first: every loss
        with ``begin_update`` sees them all before any forward (e.g. to normalise by the update's
        token count), and a contrastive update computes them against each other
        (:mod:`mmvl.trainers.contrastive_step`). The micro-batches' losses, and their tokens."""
        for _, loss_fn in self.losses:
            if hasattr(loss_fn, "begin_update"):
                loss_fn.begin_update(batches)
        if self.cached_contrast:
            micro = cached_contrastive_update(self.engine, self.model, self.losses, batches)
        else:
            micro = [self._micro_step(batch) for batch in batches]
        return micro, sum(batch_tokens(b) for b in batches)

    def _micro_step(self, batch: Any) -> dict[str, torch.Tensor]:
        """Forward, losses and backward (divided by the accumulation) of one micro-batch."""
        with self.engine.accumulate(self.model):
            with self.engine.autocast():
                losses = compute_losses(self.losses, batch, self.model(batch))
            loss = sum(losses.values())
            self.engine.backward(loss)
        return {**losses, "total_loss": loss}

    def count_flops(self, batch: Any) -> None:
        """Add the FLOPs of ``batch``'s forward, losses and backward to :attr:`flops`, on a side pass.

        :meth:`train_step` calls it for each micro-batch of the first update (they may differ in
        padded length), after that update: the update itself ran as in a run without counting
        (compiled, when compiling: under ``FlopCounterMode`` Dynamo skips), and between micro-batches
        a strategy may hold gradients a side backward would mix in (FSDP2 under ``no_sync``). The
        weights have moved by then; FLOPs depend on shapes only. The pass runs on the unwrapped model
        (no DDP reducer) under :func:`mmvl.utils.flops.leaves_no_trace`: RNG, buffers and gradients
        are as before it, so every later update is bitwise the one a run without counting makes.
        """
        module = self.engine.unwrap_model(self.model)
        inputs = dict(batch) if isinstance(batch, Mapping) else batch  # keys a forward adds stay here
        with leaves_no_trace(module, self.env.device), self.flops.counting():
            with self.engine.autocast():
                output = module(inputs)
                loss = sum(compute_losses(self.losses, inputs, output).values())
            loss.backward()

    def settle(self) -> None:
        """Read back what the step left on the device (every rank calls it at the same update).

        Raises :class:`NonFiniteLossError` on every rank when any rank's loss was NaN/inf since
        the last call, and takes back LR steps of updates the fp16 scaler skipped.
        """
        bad = self.nonfinite.check()
        if bad is not None:
            first, values = bad
            last = self.checkpoints.last_path
            raise NonFiniteLossError(
                f"Loss is not finite at update {first} (update {self.state.update}: {values}); stopped. Last good "
                f"checkpoint: {last if last.exists() else 'none yet'}. Lower "
                "optimizer.params.lr, set training.clip_grad_norm, or use training.precision=bf16.")
        if self.scheduler is not None:
            self.scheduler.settle()

    def save_checkpoint(self, is_best: bool = False, full: bool = False) -> None:
        """Checkpoint this update (every rank calls it). ``is_best``: also ``best.ckpt``;
        ``full``: one full ``last.ckpt`` even when periodic checkpoints are sharded."""
        self.settle()  # weights reached by a non-finite loss are never saved
        self.engine.save_checkpoint(self.checkpoints, self.state.update, is_best=is_best, full=full)
        self.state.last_saved = self.state.update

    def evaluate(self, split: str = "val", during_training: bool = False) -> dict[str, dict[str, float]]:
        """Metrics over the whole ``split`` of each dataset, each sample counted once (streamed);
        the best value is kept before any callback hears of the evaluation. ``during_training``: a
        periodic evaluation (``evaluation.generate_max_samples`` caps its generation metrics)."""
        self.settle()
        results = self.evaluator.evaluate(split, during_training, [c.evaluating for c in self.callbacks])
        self.state.epoch = self.epoch
        self.state.last_eval = Evaluation(self.state.update, split, results)
        self.best_tracker.update(self.state, split, results)
        self.dispatch("on_evaluation_end", split, results)
        return results

    def dispatch(self, hook: str, *args: Any) -> None:
        """``hook`` to every callback in list order, then the events published meanwhile to ``on_log``."""
        if hook not in HOOKS:
            raise ValueError(f"{hook!r} is not a hook the Trainer dispatches ({', '.join(HOOKS)})")
        for callback in self.callbacks:
            getattr(callback, hook)(*args)
        while self._published:  # in the order published, nested evaluations' events included
            event = self._published.pop(0)
            for callback in self.callbacks:
                getattr(callback, LOG_HOOK)(event)

    def publish(self, event: dict[str, Any]) -> None:
        """Queue ``event`` for every callback's ``on_log`` at the end of the running hook's round."""
        self._published.append(event)

    # -- state ------------------------------------------------------------------
    def _register_checkpointables(self, extra: Mapping[str, Any]) -> None:
        """The loop's own state joins the Engine's (model, optimizer, scaler, scheduler, RNG)."""
        register = self.engine.register_checkpointable
        register(schema.TRAINER, State(self._counters, self._load_counters))
        if self.train_data is not None:
            register(schema.DATA, self.train_data)
        register(schema.CALLBACKS, State(
            lambda: {k: c.state_dict() for k, c in zip(self.callback_keys, self.callbacks)}, self._load_callbacks))
        # saved so that a resume can compare (trainers/resume.py); nothing to load back
        register(schema.CONFIG, State(lambda: OmegaConf.to_container(self.config, resolve=True), lambda _: None))
        for name, obj in extra.items():
            register(name, obj)

    def _counters(self) -> dict[str, Any]:
        s = self.state
        return {schema.UPDATE: s.update, schema.WORLD_SIZE: self.env.world_size,
                schema.BEST_VALUE: s.best.value, schema.BEST_UPDATE: s.best.update}

    def _load_counters(self, counters: dict[str, Any]) -> None:
        self.state.update = int(counters[schema.UPDATE])
        self.state.best = Best(counters.get(schema.BEST_VALUE), counters.get(schema.BEST_UPDATE))

    def _load_callbacks(self, states: dict[str, Any]) -> None:
        """Each callback's state by its key; a checkpoint of mmvl before registered names keyed them
        by class name (one state per class): read that once, and save it under the key from then on.
        One from before :class:`TrainerState` kept the best value in early stop's state: taken from there."""
        old = states.get("early_stop", states.get("EarlyStopCallback")) or {}
        if self.state.best.value is None and old.get("best_value") is not None:
            self.state.best = Best(float(old["best_value"]), old.get("best_update"))
        legacy = set()
        for key, c in zip(self.callback_keys, self.callbacks):
            if key in states:
                c.load_state_dict(states[key])
            elif type(c).__name__ in states and type(c).__name__ not in legacy:
                legacy.add(type(c).__name__)
                c.load_state_dict(states[type(c).__name__])

    def state_dict(self, sharded: bool = False) -> dict[str, Any]:
        """The checkpoint dict (a collective); ``sharded``: all but model and optimizer."""
        return self.engine.state_dict(sharded=sharded)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a checkpoint dict (model/optimizer only if present: a sharded one loads them first)."""
        self.engine.load_state_dict(state)


def mean_losses(micro: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each loss's mean over the micro-batches of an update, detached, fp32 (no device work for one)."""
    if len(micro) == 1:
        return {k: v.detach().float() for k, v in micro[0].items()}
    return {k: torch.stack([m[k].detach().float() for m in micro]).mean() for k in micro[0]}


def run(config: DictConfig) -> dict[str, Any]:
    """Run the stages ``config.run_type`` names (train, val, test in that order) and return the results."""
    trainer = registry.TRAINERS.get(typed_section(config, "training").trainer)(config)
    run_type, state = stages(config), trainer.state
    results: dict[str, Any] = {}
    if "train" in run_type:
        trainer.fit()
        if state.preempted:  # the job is about to be killed: exit now, evaluate after the resume
            return {"updates": state.update, "preempted": state.preempted}
    for split in ("val", "test"):
        if split in run_type:
            reuse = trainer.evaluator.reuses(state.last_eval, state.update, split)
            results[split] = state.last_eval.results if reuse else trainer.evaluate(split)
    results["updates"] = state.update
    return results
