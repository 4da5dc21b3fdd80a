"""The training loop: batch -> forward -> loss -> backward -> step.

Everything else (checkpoints, evaluation schedule, logging, LR, early stop)
lives in callbacks; device, precision and parallelism live in the Engine.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from mmvl import registry
from mmvl.config import save_config
from mmvl.utils.logger import setup_logging
from mmvl.checkpoint import CheckpointManager
from mmvl.build import build_callbacks, build_datasets, build_model, model_config
from mmvl.data.sample import DevicePrefetcher
from mmvl.data.loaders import TrainStream, resolve_pin_memory
from mmvl.distributed import comm
from mmvl.distributed.env import DistEnv
from mmvl.engine import Engine
from mmvl.errors import UserError
from mmvl.losses import build_losses, compute_losses
from mmvl.metrics import build_metrics
from mmvl.optim import build_optimizer, build_scheduler
from mmvl.trainers.callbacks.checkpoint import resume
from mmvl.trainers.evaluation import evaluate as evaluate_split
from mmvl.trainers.evaluation import prepare_split
from mmvl.utils.rng import get_rng_state, seed_everything, set_rng_state

log = logging.getLogger("mmvl")


class NonFiniteLossError(UserError):
    """The loss became NaN/inf; every rank raises it at the same update."""


@registry.register_trainer("mmvl")
class Trainer:
    """Builds a run from a resolved config and trains/evaluates it."""

    def __init__(self, config: DictConfig, env: DistEnv | None = None):
        from mmvl.distributed.init import init_distributed

        self.config = config
        self.env = env or init_distributed(config)
        t = config.training
        if self.env.is_main_process:
            _check_writable(str(config.env.save_dir))
        setup_logging(str(config.env.save_dir), self.env.rank)
        seed_everything(int(t.seed))  # identical model initialisation on every rank
        self.engine = Engine(config, env=self.env)
        world = self.env.world_size
        if int(t.batch_size) % world:
            raise UserError(f"training.batch_size={t.batch_size} is not divisible by the world size "
                            f"{world}; use a multiple of {world}.")
        self.batch_size = int(t.batch_size) // world
        self.builders = build_datasets(config)
        self._prepare_data()
        self.model = build_model(config, self.builders,
                                 checkpointing=not self.engine.strategy.handles_gradient_checkpointing)
        self.losses = build_losses(list(model_config(config, self.builders).get("losses") or []))
        optimizer = build_optimizer(self.model, config, device=self.env.device)
        self.model, self.optimizer = self.engine.prepare(self.model, optimizer)
        self.metrics = {name: build_metrics(list(b.config.get("metrics") or [])
                                            + list(config.evaluation.get("metrics") or []))
                        for name, b in self.builders.items()}
        seed_everything(int(t.seed), self.env.rank)  # per-rank randomness from here on
        self.train_data = self._train_stream() if "train" in config.run_type else None
        self.update = 0
        self.max_updates = self._max_updates()
        self.scheduler = build_scheduler(self.optimizer.optimizer, config, max_updates=self.max_updates)
        self.should_stop = False
        self.preempted: str | None = None  # signal name when stopped by SIGTERM/SIGUSR1
        self.last_eval: tuple[int, str, dict] | None = None  # (update, split, results)
        self.checkpoints = CheckpointManager(str(config.env.save_dir),
                                             int(config.checkpoint.max_to_keep))
        self.callbacks = build_callbacks(config, self)
        self.resumed_from = resume(self)  # the checkpoint (file or sharded directory) or None
        if self.env.is_main_process:  # only once everything was built: a failed start changes nothing
            save_config(config, os.path.join(str(config.env.save_dir), "config.yaml"))

    # -- data -----------------------------------------------------------------
    def _prepare_data(self) -> None:
        """Rank 0 creates missing data first; the others wait, then only read."""
        if self.engine.is_main_process:
            for builder in self.builders.values():
                builder.prepare()
        comm.synchronize()
        if not self.engine.is_main_process:
            for builder in self.builders.values():
                builder.prepare()
        run_type = str(self.config.run_type)  # parse/map the splits used first (rank 0 caches them)
        for split in ["train"] if "train" in run_type else [s for s in ("val", "test") if s in run_type]:
            prepare_split(self.builders, split)

    def _train_stream(self) -> Any:
        t = self.config.training
        streams = {name: TrainStream(
            b.build("train"), batch_size=self.batch_size, collate_fn=b.collate,
            seed=int(t.seed), rank=self.env.rank, world_size=self.env.world_size,
            num_workers=int(t.num_workers), pin_memory=resolve_pin_memory(t.pin_memory, self.env.device),
            persistent_workers=bool(t.persistent_workers), name=name)
            for name, b in self.builders.items()}
        stream = next(iter(streams.values()))
        if len(streams) > 1:
            from mmvl.data.multi import MultiStream

            stream = MultiStream(streams, self.config.get("multitasking"), seed=int(t.seed))
        if self.env.device.type == "cuda" and self.engine.prefetch:  # copy the next batch on a side stream
            stream = DevicePrefetcher(stream, self.env.device)
        return stream

    def _max_updates(self) -> int:
        t = self.config.training
        if t.get("max_epochs") and self.train_data is not None:
            per_epoch = self.train_data.batches_per_epoch / self.engine.gradient_accumulation
            return max(1, int(per_epoch * float(t.max_epochs)))
        return int(t.max_updates)

    @property
    def epoch(self) -> int:
        return self.train_data.epoch if self.train_data is not None else 0

    # -- the loop -------------------------------------------------------------
    def fit(self) -> None:
        self.model.train()
        self.call("on_train_start")
        while self.update < self.max_updates and not self.should_stop:
            self.call("on_update_start")
            info = self.train_step()
            self.update += 1
            self.call("on_update_end", info)
        self.call("on_train_end")

    def train_step(self) -> dict[str, Any]:
        """One optimizer update over ``gradient_accumulation`` micro-batches."""
        engine, totals = self.engine, {}
        for _ in range(engine.gradient_accumulation):
            batch = engine.to_device(next(self.train_data))
            with engine.accumulate(self.model):
                with engine.autocast():
                    output = self.model(batch)
                    losses = compute_losses(self.losses, batch, output)
                loss = sum(losses.values())
                engine.backward(loss)
            for k, v in losses.items():
                totals[k] = totals.get(k, 0.0) + v.detach().float() / engine.gradient_accumulation
        totals["total_loss"] = sum(totals.values())
        clip = self.config.training.get("clip_grad_norm")
        grad_norm = engine.clip_grad_norm_(self.model, clip) if clip else None
        self._check_finite(totals)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return {"losses": totals, "grad_norm": grad_norm,
                "samples": self.batch_size * engine.gradient_accumulation * self.env.world_size}

    def _check_finite(self, totals: dict[str, torch.Tensor]) -> None:
        if not self.config.training.get("exit_on_nan", True) or self.engine.precision == "fp16":
            return  # under fp16 the grad scaler skips non-finite steps on every rank
        bad = (~torch.isfinite(totals["total_loss"])).float()
        bad = comm.all_reduce(bad, "max")
        if bad.item():
            last = os.path.join(self.config.env.save_dir, "checkpoints", "last.ckpt")
            values = ", ".join(f"{k}={v.item():.4g}" for k, v in totals.items())
            raise NonFiniteLossError(
                f"Loss is not finite at update {self.update + 1} ({values}); stopped. Last good "
                f"checkpoint: {last if os.path.exists(last) else 'none yet'}. Lower "
                "optimizer.params.lr, set training.clip_grad_norm, or use training.precision=bf16.")

    def evaluate(self, split: str = "val") -> dict[str, dict[str, float]]:
        """Metrics over the whole ``split`` of each dataset, each sample counted once (streamed)."""
        results = evaluate_split(self, split)
        self.last_eval = (self.update, split, results)
        self.call("on_evaluation_end", split, results)
        return results

    def call(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(*args)

    # -- state ------------------------------------------------------------------
    def state_dict(self, sharded: bool = False) -> dict[str, Any]:
        """The checkpoint dict (a collective); ``sharded``: all but model and optimizer."""
        state = self.engine.state_dict(self.model, self.optimizer, self.scheduler, sharded=sharded)
        state["trainer"] = {"update": self.update, "world_size": self.env.world_size}
        state["data"] = self.train_data.state_dict() if self.train_data is not None else {}
        state["rng"] = comm.all_gather_object(get_rng_state())
        state["callbacks"] = {type(c).__name__: c.state_dict() for c in self.callbacks}
        state["config"] = OmegaConf.to_container(self.config, resolve=True)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a checkpoint dict (model/optimizer only if present: a sharded one loads them first)."""
        self.engine.load_state_dict(state, self.model, self.optimizer, self.scheduler)
        self.update = int(state["trainer"]["update"])
        if self.train_data is not None and state.get("data"):
            self.train_data.load_state_dict(state["data"])
        rngs = state.get("rng") or []
        if len(rngs) == self.env.world_size:
            set_rng_state(rngs[self.env.rank])
        for c in self.callbacks:
            if type(c).__name__ in (state.get("callbacks") or {}):
                c.load_state_dict(state["callbacks"][type(c).__name__])


def _check_writable(save_dir: str) -> None:
    try:
        os.makedirs(save_dir, exist_ok=True)
        probe = os.path.join(save_dir, f".write_test_{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise UserError(f"env.save_dir={save_dir!r} is not writable ({e.strerror}); "
                        "choose another env.save_dir or fix its permissions.") from None


def run(config: DictConfig) -> dict[str, Any]:
    """Run ``config.run_type`` (train, val, test, train_val, train_test) and return the results."""
    trainer = registry.TRAINERS.get(config.training.get("trainer", "mmvl"))(config)
    run_type = str(config.run_type)
    results: dict[str, Any] = {}
    if "train" in run_type:
        trainer.fit()
        if trainer.preempted:  # the job is about to be killed: exit now, evaluate after the resume
            return {"updates": trainer.update, "preempted": trainer.preempted}
    for split in ("val", "test"):
        if split in run_type:
            last = trainer.last_eval
            fresh = last is not None and last[0] == trainer.update and last[1] == split
            results[split] = last[2] if fresh else trainer.evaluate(split)
    results["updates"] = trainer.update
    return results
