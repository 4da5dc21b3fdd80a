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
back from the device on a normal update: under fp16 whether the scaler skipped
an update stays a device flag (``optimizer.skipped``), and a prepared LR
scheduler takes back the steps of skipped updates when it ``settle()``-s.

The Trainer is built on the same object, so both paths share one
implementation of precision, accumulation and strategy handling.
"""
from __future__ import annotations

import atexit
import contextlib
import warnings
from typing import Any, Iterator

import torch
from omegaconf import DictConfig, OmegaConf

from mmvl.data.sample import DevicePrefetcher, to_device
from mmvl.distributed import comm
from mmvl.distributed.env import DistEnv
from mmvl.distributed.strategies.base import Strategy
from mmvl.errors import UserError
from mmvl.utils.precision import compute_dtype


class PreparedOptimizer:
    """Wraps an optimizer so ``step``/``zero_grad`` act only at accumulation boundaries.

    Under fp16 the step goes through the grad scaler, which skips updates whose
    gradients are not finite. Whether it did is left on the device (``skipped``, a
    bool tensor) instead of being read on every update; ``step_was_skipped`` reads
    it (and so waits for the device). Everything else is forwarded to the wrapped
    optimizer.
    """

    def __init__(self, engine: "Engine", optimizer: torch.optim.Optimizer):
        self.engine = engine
        self.optimizer = optimizer
        #: fp16: True (on the device) when the scaler skipped the last update; None otherwise
        self.skipped: torch.Tensor | None = None

    def step(self, closure: Any = None) -> None:
        if not self.engine.sync_gradients:
            return
        scaler = self.engine.scaler
        if scaler is None:
            self.optimizer.step(closure)
            return
        if not self.engine._unscaled:
            scaler.unscale_(self.optimizer)
        before = _scale_of(scaler).clone()
        scaler.step(self.optimizer)
        scaler.update()
        # the scaler backs off (lowers its scale) exactly when it skipped the update
        self.skipped = _scale_of(scaler) < before
        self.engine._unscaled = False

    @property
    def step_was_skipped(self) -> bool:
        """Whether the fp16 scaler skipped the last update (waits for the device)."""
        return self.skipped is not None and bool(self.skipped)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.engine.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


def _scale_of(scaler: Any) -> torch.Tensor:
    """The scaler's current scale as a tensor on its device (no host read)."""
    scale = getattr(scaler, "_scale", None)  # torch's GradScaler keeps it there, updated in place
    return scale if isinstance(scale, torch.Tensor) else torch.tensor(float(scaler.get_scale()))


class PreparedScheduler:
    """Steps the LR schedule once per optimizer update, never per micro-step, and not for
    updates the fp16 scaler skipped.

    Which updates were skipped is known on the device only. Instead of waiting for it on
    every update, a closed-form schedule (``LambdaLR``: all of mmvl's) steps at once and is
    moved back by the number of skipped updates when :meth:`settle` reads that count (the
    Trainer does at every log interval, and ``state_dict`` does before a checkpoint). In
    between, the lr may be ahead by the few updates skipped there. Other schedulers read the
    flag on every update (exact, but a wait on the device).
    """

    def __init__(self, engine: "Engine", scheduler: Any):
        self.engine = engine
        self.scheduler = scheduler
        self._skipped: torch.Tensor | None = None  # skipped updates not yet taken back (device)

    def step(self) -> None:
        if not self.engine.sync_gradients:
            return
        optimizer = self.engine._prepared.get("optimizer")
        skipped = getattr(optimizer, "skipped", None)
        if skipped is None:
            self.scheduler.step()
        elif not isinstance(self.scheduler, torch.optim.lr_scheduler.LambdaLR):
            if not bool(skipped):
                self.scheduler.step()
        else:
            with warnings.catch_warnings():  # torch warns when the scaler skipped the optimizer's step
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
                self.scheduler.step()
            self._skipped = skipped.int() if self._skipped is None else self._skipped + skipped

    def settle(self) -> None:
        """Take back the steps taken for skipped fp16 updates (reads one number from the device)."""
        if self._skipped is None:
            return
        behind, self._skipped = int(self._skipped.item()), None
        if behind:
            self.scheduler.last_epoch -= behind + 1
            self.scheduler.step()  # recomputes every group's lr at the corrected position

    def state_dict(self) -> dict[str, Any]:
        self.settle()
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._skipped = None
        self.scheduler.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)


class Engine:
    """Owns device, precision, gradient accumulation and the parallel strategy."""

    def __init__(self, config: DictConfig | None = None, *, env: DistEnv | None = None,
                 precision: str | None = None, gradient_accumulation: int | None = None,
                 strategy: str | Strategy | None = None, device: str | torch.device | None = None,
                 prefetch: bool | None = None):
        """``device``: ``auto`` (CUDA when present), ``cpu``, ``cuda`` or ``cuda:N`` (one process),
        as ``training.device``; ``prefetch``: as ``training.prefetch`` (default true)."""
        config = config if config is not None else OmegaConf.create({})
        if device is not None:
            if env is not None:
                raise UserError("Engine(env=..., device=...): the env already names the device; pass one.")
            config = OmegaConf.merge(config, {"training": {"device": str(device)}})
        training = config.get("training", {}) or {}
        self.config = config
        self.env = env or _init_process(config)
        self.precision = precision or training.get("precision", "fp32")
        if training.get("fp16") and precision is None:
            self.precision = "fp16"
        self._dtype = compute_dtype(self.precision)  # a UserError for an unknown name
        k = gradient_accumulation or training.get("gradient_accumulation", 1) or 1
        if int(k) < 1:
            raise UserError(f"training.gradient_accumulation={k} must be >= 1.")
        self.gradient_accumulation = int(k)
        self.strategy = strategy if isinstance(strategy, Strategy) else _build_strategy(
            config, self.env, strategy)
        self.scaler = self.strategy.make_grad_scaler(self.precision == "fp16")
        self.prefetch = bool(training.get("prefetch", True) if prefetch is None else prefetch)
        self.compile = bool(training.get("compile", False))
        self.compile_backend = str(training.get("compile_backend") or "inductor")
        if self.compile and self.strategy.name == "dp":
            raise UserError("training.compile=true does not work with distributed.strategy=dp (its replicas "
                            "would share one compiled forward); use ddp (torchrun) or training.compile=false.")
        self.sync_gradients = True
        self._micro_step = 0
        self._unscaled = False
        self._prepared: dict[str, Any] = {}

    # -- properties ---------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.env.device

    @property
    def is_main_process(self) -> bool:
        return self.env.is_main_process

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    # -- set-up ---------------------------------------------------------------
    def prepare(self, *objs: Any) -> Any:
        """Move/wrap models, wrap optimizers, schedulers and data loaders, in the order given."""
        model = next((o for o in objs if isinstance(o, torch.nn.Module)), None)
        optimizer = next((o for o in objs if isinstance(o, torch.optim.Optimizer)), None)
        wrapped_model, new_opt = None, None
        if model is not None:
            model = model.to(self.device)
            if self.compile:
                compile_model(model, self.compile_backend, per_unit=self.strategy.name != "single")
            wrapped_model, new_opt = self.strategy.wrap(model, optimizer)
            self._prepared["model"] = wrapped_model
        out = []
        for o in objs:
            if o is model and model is not None:
                out.append(wrapped_model)
            elif isinstance(o, torch.optim.Optimizer):
                inner = new_opt if (o is optimizer and new_opt is not None) else o
                prepared = PreparedOptimizer(self, inner)
                self._prepared["optimizer"] = prepared
                out.append(prepared)
            elif isinstance(o, torch.optim.lr_scheduler.LRScheduler):
                if new_opt is not None and o.optimizer is optimizer:
                    _rebind_scheduler(o, new_opt)
                prepared = PreparedScheduler(self, o)
                self._prepared["scheduler"] = prepared
                out.append(prepared)
            elif isinstance(o, torch.utils.data.DataLoader):
                out.append(DeviceLoader(self._shard_loader(o), self.device, self.prefetch))
            else:
                out.append(o)
        return out[0] if len(out) == 1 else tuple(out)

    def _shard_loader(self, loader: torch.utils.data.DataLoader) -> torch.utils.data.DataLoader:
        """Give each rank its own part of the data (a DistributedSampler), keeping batch size."""
        if self.world_size == 1 or isinstance(loader.sampler, torch.utils.data.DistributedSampler):
            return loader
        shuffle = isinstance(loader.sampler, torch.utils.data.RandomSampler)
        sampler = torch.utils.data.DistributedSampler(
            loader.dataset, num_replicas=self.world_size, rank=self.rank, shuffle=shuffle)
        return torch.utils.data.DataLoader(
            loader.dataset, batch_size=loader.batch_size, sampler=sampler,
            num_workers=loader.num_workers, collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory, drop_last=loader.drop_last)

    # -- per step ---------------------------------------------------------
    @contextlib.contextmanager
    def accumulate(self, model: torch.nn.Module) -> Iterator[None]:
        """One micro-step; gradients are communicated only on the last of each group."""
        self._micro_step += 1
        self.sync_gradients = self._micro_step % self.gradient_accumulation == 0
        ctx = contextlib.nullcontext() if self.sync_gradients else self.strategy.no_sync(model)
        with ctx:
            yield

    def autocast(self) -> contextlib.AbstractContextManager:
        dtype = self._dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss / gradient_accumulation``, through the scaler under fp16."""
        if self.gradient_accumulation > 1:
            loss = loss / self.gradient_accumulation
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def clip_grad_norm_(self, model: torch.nn.Module, max_norm: float,
                        optimizer: PreparedOptimizer | None = None) -> torch.Tensor | None:
        """Unscale (fp16) and clip at the boundary; returns the global norm (None off-boundary)."""
        if not self.sync_gradients:
            return None
        opt = optimizer or self._prepared.get("optimizer")
        inner = opt.optimizer if isinstance(opt, PreparedOptimizer) else opt
        if self.scaler is not None and not self._unscaled:
            self.scaler.unscale_(inner)
            self._unscaled = True
        return self.strategy.clip_grad_norm_(model, inner, float(max_norm))

    def to_device(self, batch: Any) -> Any:
        if self.device.type == "cpu":  # batches come from host memory: nothing to move (or walk through)
            return batch
        return to_device(batch, self.device)

    # -- collectives ------------------------------------------------------------
    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along dim 0 (scalars are stacked)."""
        parts = comm.all_gather(tensor.reshape(1) if tensor.dim() == 0 else tensor)
        return torch.cat(parts)

    def gather_for_metrics(self, data: Any, num_samples: int) -> Any:
        return comm.gather_for_metrics(data, num_samples)

    def wait_for_everyone(self) -> None:
        comm.synchronize()

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.strategy.unwrap(model)

    # -- state --------------------------------------------------------------------
    @property
    def sharded_checkpoint(self) -> bool:
        """Whether checkpoints are written per rank (``distributed.sharded_checkpoint`` under fsdp)."""
        return self.strategy.sharded_checkpoint

    def state_dict(self, model: torch.nn.Module, optimizer: Any = None,
                   scheduler: Any = None, sharded: bool = False) -> dict[str, Any]:
        """Model/optimizer/scaler/scheduler state, consolidated to full tensors.

        ``sharded``: without model and optimizer (they go through :meth:`save_sharded`).
        """
        if isinstance(scheduler, PreparedScheduler):
            scheduler.settle()
        inner, sched = _inner(optimizer), _inner(scheduler)
        state: dict[str, Any] = {} if sharded else {"model": self.strategy.model_state_dict(model)}
        if inner is not None and not sharded:
            state["optimizer"] = self.strategy.optimizer_state_dict(model, inner)
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        if sched is not None:
            state["scheduler"] = sched.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any], model: torch.nn.Module,
                        optimizer: Any = None, scheduler: Any = None) -> None:
        """Load a full state; model and optimizer only when present (see :meth:`load_sharded`)."""
        if "model" in state:
            self.strategy.load_model_state_dict(model, state["model"])
        inner = _inner(optimizer)
        if inner is not None and state.get("optimizer") is not None:
            self.strategy.load_optimizer_state_dict(model, inner, state["optimizer"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        sched = _inner(scheduler)
        if sched is not None and state.get("scheduler") is not None:
            sched.load_state_dict(state["scheduler"])

    def save_sharded(self, directory: str, model: torch.nn.Module, optimizer: Any = None,
                     extra: dict[str, Any] | None = None) -> None:
        """Every rank writes its part of model+optimizer; rank 0 adds ``extra``, then the marker."""
        from mmvl.checkpoint import save_sharded

        save_sharded(directory, self.strategy, model, _inner(optimizer), extra=extra)

    def can_load_sharded(self, optimizer: Any = None) -> bool:
        return self.strategy.can_load_sharded(_inner(optimizer))

    def load_sharded(self, directory: str, model: torch.nn.Module, optimizer: Any = None) -> None:
        """Every rank reads model (+optimizer unless None) from a complete sharded directory
        (re-sharded to this world size)."""
        from mmvl.checkpoint import load_sharded

        load_sharded(directory, self.strategy, model, _inner(optimizer))

    def save_state(self, path: str) -> None:
        """Save what ``prepare`` saw (model, optimizer, scaler, scheduler, RNG) to one file."""
        from mmvl.checkpoint import atomic_save
        from mmvl.utils.rng import get_rng_state

        state = self.state_dict(self._prepared["model"], self._prepared.get("optimizer"),
                                self._prepared.get("scheduler"))
        state["rng"] = comm.all_gather_object(get_rng_state())
        if self.is_main_process:
            atomic_save(state, path)
        self.wait_for_everyone()

    def load_state(self, path: str) -> None:
        from mmvl.checkpoint import safe_load
        from mmvl.utils.rng import set_rng_state

        state = safe_load(path)
        self.load_state_dict(state, self._prepared["model"], self._prepared.get("optimizer"),
                             self._prepared.get("scheduler"))
        rngs = state.get("rng") or []
        if len(rngs) == self.world_size:
            set_rng_state(rngs[self.rank])


class DeviceLoader:
    """Iterates a DataLoader and moves each batch to the device.

    Each ``iter()`` is a new pass over the loader, as with the DataLoader itself. On
    CUDA with ``prefetch`` the next batch is copied on a side stream while the current
    one computes (pin the DataLoader's memory, ``pin_memory=True``, for the copy to
    overlap).
    """

    def __init__(self, loader: torch.utils.data.DataLoader, device: torch.device, prefetch: bool = True):
        self.loader = loader
        self.device = device
        self.prefetch = prefetch

    def __iter__(self) -> Iterator[Any]:
        if self.prefetch and self.device.type == "cuda":
            yield from DevicePrefetcher(self.loader, self.device)
            return
        for batch in self.loader:
            yield to_device(batch, self.device)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


def compile_model(model: torch.nn.Module, backend: str = "inductor", per_unit: bool = False) -> None:
    """``torch.compile`` ``model`` in place, before any parallel wrapper.

    ``Module.compile`` keeps parameter names (and so checkpoints) those of the eager
    model: no ``_orig_mod.`` prefixes. ``per_unit`` compiles each of ``model.shard_units()``
    (its transformer layers) on its own, which keeps DDP's bucketed all-reduce and FSDP's
    per-layer gathers overlapping backward; without units, or one process, the whole model
    is compiled (the most fusion).
    """
    units = list(model.shard_units()) if per_unit and hasattr(model, "shard_units") else []
    for module in units or [model]:
        module.compile(backend=backend)


def _inner(obj: Any) -> Any:
    """The optimizer/scheduler a PreparedOptimizer/PreparedScheduler wraps (else ``obj``)."""
    if isinstance(obj, PreparedOptimizer):
        return obj.optimizer
    return obj.scheduler if isinstance(obj, PreparedScheduler) else obj


def _rebind_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    for group, base_lr in zip(optimizer.param_groups, scheduler.base_lrs):
        group.setdefault("initial_lr", base_lr)
    scheduler.optimizer = optimizer


def _init_process(config: Any) -> DistEnv:
    """Read the launcher and join its process group when none exists yet (as Accelerate does);
    a group this creates is left again at exit."""
    from mmvl.distributed.init import destroy, init_distributed

    existed = comm.is_initialized()
    env = init_distributed(config)
    if not existed and comm.is_initialized():
        atexit.register(destroy)
    return env


def _build_strategy(config: DictConfig, env: DistEnv, name: str | None) -> Strategy:
    try:
        from mmvl.distributed.strategies import build_strategy
    except ImportError:  # the strategies package is optional at import time
        return Strategy(config, env)
    if name is not None:
        config = OmegaConf.merge(config, {"distributed": {"strategy": name}})
    return build_strategy(config, env)
