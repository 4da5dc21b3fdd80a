"""Engine: device, precision and parallel strategy behind a few calls.

Usable on its own from research code, the way Accelerate users write loops::

    engine = Engine(precision="bf16", gradient_accumulation=4)
    model, optimizer, loader = engine.prepare(model, optimizer, loader)
    for batch in loader:
        with engine.accumulate(model):
            with engine.autocast():
                loss = model(batch)["loss"]
            engine.backward(loss)
            engine.clip_grad_norm_(model, 1.0)
            optimizer.step()        # a no-op until the accumulation boundary
            optimizer.zero_grad()

The same script runs under ``python`` and under ``torchrun``: without an ``env``
the Engine reads the launcher (torchrun, SLURM), joins the process group itself
when none exists yet, and puts each process on its own GPU
(``torch.cuda.set_device``). On CUDA the prepared loader copies the next batch
on a side stream while the current one computes (``prefetch``).

With ``training.compile: true`` in its config, ``prepare`` compiles the model
(:func:`compile_model`) before the strategy wraps it. Nothing here reads a value
back from the device on a normal update (see :mod:`mmvl.engine.prepared`).

What a checkpoint holds is the Engine's named checkpointables: the model, optimizer,
scaler, scheduler and RNG it prepares, plus whatever the Trainer or user code registers
(:meth:`Engine.register_checkpointable`). The Trainer is built on the same object, so both
paths share one implementation of precision, accumulation, strategy and checkpoint handling.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from omegaconf import DictConfig

from mmvl.checkpoint import CheckpointManager, Checkpointables, schema
from mmvl.data.sample import to_device
from mmvl.distributed import comm
from mmvl.distributed.env import DistEnv
from mmvl.distributed.strategies.base import Strategy
from mmvl.engine import nested, state as engine_state
from mmvl.engine.accelerate import accelerate_keywords, autocast_forward, launched_accumulation, launched_precision
from mmvl.engine.accelerator import AcceleratorMembers
from mmvl.engine.loaders import PreparedLoader
from mmvl.engine.process import AcceleratorState
from mmvl.engine.sections import EngineSections, build_engine_strategy, init_process
from mmvl.engine.plugins import GradientState, accumulation_plugin, dataloader_configuration, plugin_steps
from mmvl.engine.prepared import PreparedOptimizer, PreparedScheduler, inner, rebind_scheduler
from mmvl.errors import UserError
from mmvl import tracking
from mmvl.utils.compile import compile_model
from mmvl.utils.precision import apply_matmul_precision, compute_dtype


class Engine(AcceleratorMembers):
    """Owns device, precision, gradient accumulation and the parallel strategy.

    It is also Accelerate's ``Accelerator`` (:mod:`mmvl.engine.accelerator` holds the members
    Accelerate scripts use; ``mixed_precision``/``gradient_accumulation_steps``/``cpu`` are
    ``precision``/``gradient_accumulation``/``device`` under Accelerate's names).
    """

    def __init__(self, config: DictConfig | None = None, *, sections: EngineSections | None = None,
                 env: DistEnv | None = None,
                 precision: str | None = None, gradient_accumulation: int | None = None,
                 strategy: str | Strategy | None = None, device: str | torch.device | None = None,
                 prefetch: bool | None = None, mixed_precision: str | None = None, cpu: bool = False,
                 gradient_accumulation_steps: int | None = None, project_dir: str | os.PathLike[str] | None = None,
                 log_with: Any = None, dataloader_config: Any = None, gradient_accumulation_plugin: Any = None):
        """``config``: a loaded config, split here into its :class:`EngineSections` (or pass
        ``sections``); ``device``: ``auto`` (CUDA when present), ``cpu``, ``cuda`` or ``cuda:N`` (one process),
        as ``training.device``; ``prefetch``: as ``training.prefetch`` (default true);
        ``project_dir``: where ``save_state()`` without a folder writes ``checkpoints/checkpoint_<n>``
        and trackers write their files; ``log_with``: ``"all"``, a tracker name or a list (see
        :mod:`mmvl.tracking`); ``dataloader_config``/``gradient_accumulation_plugin``: how loaders are
        sharded and micro-steps counted (:mod:`mmvl.engine.plugins`; Accelerate's objects too)."""
        #: how ``prepare`` shards loaders (read when a loader is prepared; may be replaced in between)
        self.dataloader_config = dataloader_configuration(dataloader_config)
        plugin = accumulation_plugin(gradient_accumulation_plugin)
        gradient_accumulation_steps = plugin_steps(plugin, gradient_accumulation_steps)
        #: the loop's shared state: active loader, its end, whether this micro-step syncs
        self.gradient_state = GradientState(plugin)
        precision, gradient_accumulation, device = accelerate_keywords(
            precision=precision, gradient_accumulation=gradient_accumulation, mixed_precision=mixed_precision,
            gradient_accumulation_steps=gradient_accumulation_steps, cpu=cpu, device=device)
        scripted = config is None and sections is None  # a script's Engine, made without a config
        if scripted:  # what mmvl_launch chose, where its arguments say nothing
            precision = precision if precision is not None else launched_precision()
            gradient_accumulation = gradient_accumulation or launched_accumulation()
        self._start_trackers_and_loaders(project_dir, log_with)
        #: Accelerate's schedule rule for a script's Engine (made without a config): see PreparedScheduler
        self.scheduler_per_process = scripted
        sections = sections if sections is not None else EngineSections.of(config)
        if device is not None:
            if env is not None:
                raise UserError("Engine(env=..., device=...): the env already names the device; pass one.")
            sections = sections.with_device(device)
        training = sections.training  # typed, with the schema's defaults for what is unset
        #: the sections this Engine was built from
        self.sections = sections
        self.env = env or init_process(sections)
        apply_matmul_precision(training.matmul_precision, self.device.type, announce=self.is_main_process)
        self.precision = precision or training.precision  # MMF's fp16 flag was resolved at load
        self._dtype = compute_dtype(self.precision)  # a UserError for an unknown name
        self.gradient_accumulation = _accumulation(gradient_accumulation or training.gradient_accumulation or 1)
        self.strategy = strategy if isinstance(strategy, Strategy) else build_engine_strategy(
            sections, self.env, strategy, self._dtype)
        self.scaler = self.strategy.make_grad_scaler(self.precision == "fp16")
        self._generation = AcceleratorState._set(self.env, self._strategy_distributed_type(), self.mixed_precision)
        self.prefetch = bool(training.prefetch if prefetch is None else prefetch)
        self._compile_settings(training)
        self._micro_step = 0
        #: fp16: the prepared optimizer's gradients were unscaled for clipping in this update
        self.grads_unscaled = False
        self._prepared: dict[str, Any] = {}
        #: what a checkpoint of this Engine holds, by name (see :meth:`register_checkpointable`)
        self.checkpointables = Checkpointables()
        for name, obj in ((schema.SCALER, self.scaler), (schema.RNG, engine_state.rng_state(self.env))):
            if obj is not None:
                self.checkpointables.register(name, obj)

    def _compile_settings(self, training: Any) -> None:
        """``training.compile`` and its backend, refused where the strategy's replicas would share one
        compiled forward (DataParallel)."""
        self.compile = bool(training.compile)
        self.compile_backend = str(training.compile_backend or "inductor")
        if self.compile and self.strategy.replicas_in_one_process:
            raise UserError("training.compile=true does not work with distributed.strategy=dp (its replicas "
                            "would share one compiled forward); use ddp (torchrun) or training.compile=false.")

    def _start_trackers_and_loaders(self, project_dir: str | os.PathLike[str] | None, log_with: Any) -> None:
        """Where ``save_state()`` and trackers write, the trackers ``log_with`` names (checked here, on
        every rank; made by ``init_trackers``), and no prepared loaders yet."""
        self.project_dir = None if project_dir is None else str(project_dir)
        self.log_with = tracking.resolve(log_with, f"Engine(log_with={log_with!r})")
        self.trackers: list[tracking.Tracker] = []
        self._loader_names: list[str] = []
        self._loaders: list[PreparedLoader] = []  # what join_uneven_inputs overrides

    # -- properties ---------------------------------------------------------
    @property
    def sync_gradients(self) -> bool:
        """Whether this micro-step ends an update (the optimizer steps; gradients are communicated)."""
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state.sync_gradients = bool(value)

    @property
    def device(self) -> torch.device:
        return self.env.device

    @property
    def is_main_process(self) -> bool:
        return self.env.is_main_process

    rank = property(lambda self: self.env.rank, doc="this process's rank")
    world_size = property(lambda self: self.env.world_size, doc="the number of processes")

    @property
    def prepared_model(self) -> torch.nn.Module | None:
        """The model :meth:`prepare` returned (wrapped by the strategy), or None."""
        return self._prepared.get("model")

    @property
    def prepared_optimizer(self) -> PreparedOptimizer | None:
        """The optimizer :meth:`prepare` returned, or None."""
        return self._prepared.get("optimizer")

    # -- set-up ---------------------------------------------------------------
    def prepare(self, *objs: Any) -> Any:
        """Move/wrap models, wrap optimizers, schedulers and data loaders, in the order given."""
        AcceleratorState._check(self._generation)
        model = next((o for o in objs if isinstance(o, torch.nn.Module)), None)
        optimizer = next((o for o in objs if isinstance(o, torch.optim.Optimizer)), None)
        wrapped_model, new_opt = None, None
        if model is not None:
            model = model.to(self.device)
            if self._dtype is not None:
                autocast_forward(self, model)
            if self.compile:
                compile_model(model, self.compile_backend, per_unit=self.strategy.communicates_in_backward)
            wrapped_model, new_opt = self.strategy.wrap(model, optimizer)
            self._prepared["model"] = wrapped_model
            self.checkpointables.unregister(schema.MODEL)  # a second prepare() replaces the first
            self.checkpointables.register(schema.MODEL, engine_state.ModelState(self.strategy, wrapped_model))
        out = []
        for o in objs:
            if o is model and model is not None:
                out.append(wrapped_model)
            elif isinstance(o, torch.optim.Optimizer):
                inner = new_opt if (o is optimizer and new_opt is not None) else o
                prepared = PreparedOptimizer(self, inner)
                self._prepared["optimizer"] = prepared
                if schema.OPTIMIZER not in self.checkpointables:
                    self.checkpointables.register(schema.OPTIMIZER, engine_state.OptimizerState(self))
                out.append(prepared)
            elif isinstance(o, torch.optim.lr_scheduler.LRScheduler):
                if new_opt is not None and o.optimizer is optimizer:
                    rebind_scheduler(o, new_opt)
                prepared = PreparedScheduler(self, o)
                self._prepared["scheduler"] = prepared
                self.checkpointables.unregister(schema.SCHEDULER)
                self.checkpointables.register(schema.SCHEDULER, prepared)
                out.append(prepared)
            elif isinstance(o, torch.utils.data.DataLoader):
                out.append(self._prepare_loader(o))
            else:
                out.append(o)
        return out[0] if len(out) == 1 else tuple(out)

    def _prepare_loader(self, loader: torch.utils.data.DataLoader) -> PreparedLoader:
        """This rank's shard of ``loader``, its position saved with the state (see :mod:`mmvl.engine.loaders`).
        The run's seed is rank 0's torch seed (``set_seed``'s), so every rank draws the same orders."""
        config = self.dataloader_config = dataloader_configuration(self.dataloader_config)
        seed = config.data_seed if config.data_seed is not None else comm.broadcast_object(torch.initial_seed())
        prepared = PreparedLoader(self, loader, seed, config)
        name = schema.loader_name(len(self._loader_names))
        self._loader_names.append(name)
        self._loaders.append(prepared)
        self.checkpointables.register(name, prepared)
        return prepared

    # -- per step ---------------------------------------------------------
    @contextlib.contextmanager
    def accumulate(self, model: torch.nn.Module) -> Iterator[None]:
        """One micro-step; gradients are communicated only on the last of each group (on every one
        with ``sync_each_batch``; the optimizer still steps only at the group's end)."""
        self._micro_step += 1
        state = self.gradient_state
        last = state.sync_with_dataloader and state.end_of_dataloader
        self.sync_gradients = self._micro_step % self.gradient_accumulation == 0 or last
        if last:  # as Accelerate: the epoch's last batch always syncs
            self._micro_step = 0
        communicate = self.sync_gradients or state.sync_each_batch
        ctx = contextlib.nullcontext() if communicate else self.strategy.no_sync(model)
        with ctx:
            yield

    def autocast(self) -> contextlib.AbstractContextManager:
        dtype = self._dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def backward(self, loss: torch.Tensor, divide: bool = True) -> None:
        """Backward of ``loss / gradient_accumulation``, through the scaler under fp16.

        ``divide=False``: ``loss`` is already the whole update's loss (a contrastive step recomputes
        each micro-batch against the cached rest, :mod:`mmvl.trainers.contrastive_step`): not divided."""
        if divide and self.gradient_accumulation > 1:
            loss = loss / self.gradient_accumulation
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0,
                        optimizer: PreparedOptimizer | None = None) -> torch.Tensor | None:
        """Unscale (fp16) and clip at the boundary; returns the global norm (None off-boundary).

        ``parameters``: the prepared model or its parameters (Accelerate's form)."""
        if not self.sync_gradients:
            return None
        opt = inner(optimizer or self.prepared_optimizer)
        if self.scaler is not None and not self.grads_unscaled:
            self.scaler.unscale_(opt)
            self.grads_unscaled = True
        if isinstance(parameters, torch.nn.Module):
            return self.strategy.clip_grad_norm_(parameters, opt, float(max_norm))
        params = list(parameters)
        if self.strategy.full_gradients:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        model = self.prepared_model
        if model is None or {id(p) for p in params} != {id(p) for p in model.parameters()}:
            raise UserError(f"clip_grad_norm_(parameters, ...) under distributed.strategy={self.strategy.name} "
                            "clips the whole prepared model only; pass model.parameters() or the model.")
        return self.strategy.clip_grad_norm_(model, opt, float(max_norm))

    def to_device(self, batch: Any) -> Any:
        return batch if self.device.type == "cpu" else to_device(batch, self.device)  # CPU: nothing to move

    # -- collectives ------------------------------------------------------------
    def gather(self, tensor: Any) -> Any:
        """Every rank's ``tensor`` concatenated along dim 0 (scalars are stacked); a tuple, list or
        dict of tensors (nested) is gathered leaf by leaf, keeping its shape."""
        return nested.gather(tensor)

    def wait_for_everyone(self) -> None:
        comm.synchronize()

    # thin doors to mmvl.distributed.comm for trainers and callbacks (static: they need no prepared state)
    @staticmethod
    def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """``tensor`` reduced in place over every rank (``op``: sum, mean, max, min)."""
        return comm.all_reduce(tensor, op)

    @staticmethod
    def reduce_dict(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each scalar's mean over the ranks, in one all-reduce for the whole dict."""
        return comm.reduce_dict(values)

    @staticmethod
    def gather_object(obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order, on every rank."""
        return comm.all_gather_object(obj)

    @staticmethod
    def async_max(value: int) -> comm.AsyncMax:
        """The maximum of ``value`` over the ranks, started now and read later (``.result()``)."""
        return comm.AsyncMax(value)

    @staticmethod
    def on_main_agreed(fn: Callable[[], Any], what: str) -> Any:
        """``fn`` on rank 0 only, its result broadcast; when it fails every rank raises."""
        return comm.on_main_agreed(fn, what)

    @staticmethod
    def all_ranks_agreed(error: str | None, what: str) -> None:
        """Each rank's own problem (or None); when any rank has one, every rank raises it."""
        comm.all_ranks_agreed(error, what)

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.strategy.unwrap(model)

    # -- state --------------------------------------------------------------------
    @property
    def sharded_checkpoint(self) -> bool:
        """Whether checkpoints are written per rank (``distributed.sharded_checkpoint`` under fsdp)."""
        return self.strategy.sharded_checkpoint

    def register_checkpointable(self, name: str, obj: Any) -> None:
        """Save and load ``obj`` (anything with ``state_dict``/``load_state_dict``) under ``name``
        in every checkpoint and :meth:`save_state`."""
        self.checkpointables.register(name, obj)

    def state_dict(self, sharded: bool = False) -> dict[str, Any]:
        """Every checkpointable's state (a collective: every rank calls it), full tensors.

        ``sharded``: without model and optimizer (they go through :meth:`save_sharded`).
        """
        return self.checkpointables.state_dict(skip=schema.SHARDED_KEYS if sharded else ())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Give every checkpointable its part of ``state``; model and optimizer only when present
        (a sharded checkpoint loads them through :meth:`load_sharded`)."""
        self.checkpointables.load_state_dict(schema.upgrade(state))

    def save_checkpoint(self, manager: CheckpointManager, update: int, is_best: bool = False,
                        full: bool = False) -> None:
        """Checkpoint ``update`` into ``manager``'s folder, full or sharded (every rank calls it)."""
        engine_state.save_checkpoint(self, manager, update, is_best=is_best, full=full)

    def save_sharded(self, directory: str | os.PathLike[str], extra: dict[str, Any] | None = None) -> Path:
        """Every rank writes its part of model+optimizer; rank 0 adds ``extra``, then the marker."""
        return engine_state.save_sharded(directory, self.strategy, self.prepared_model,
                                         inner(self.prepared_optimizer), extra=extra)

    def can_load_sharded(self, optimizer: bool = True) -> bool:
        """Whether this strategy reads sharded checkpoints (with the optimizer state, by default)."""
        return self.strategy.can_load_sharded(inner(self.prepared_optimizer) if optimizer else None)

    def load_sharded(self, directory: str | os.PathLike[str], optimizer: bool = True) -> None:
        """Every rank reads the model (and optimizer) from a complete sharded folder (re-sharded to
        this world size)."""
        engine_state.load_sharded(directory, self.strategy, self.prepared_model,
                                  inner(self.prepared_optimizer) if optimizer else None)


def _accumulation(k: Any) -> int:
    """``training.gradient_accumulation`` (or the keyword) checked: micro-batches per update, 1 or more."""
    if int(k) < 1:
        raise UserError(f"training.gradient_accumulation={k} must be >= 1.")
    return int(k)
