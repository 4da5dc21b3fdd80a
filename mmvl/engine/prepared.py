"""What ``Engine.prepare`` hands back: an optimizer, a scheduler and a loader that know the Engine.

Under fp16 the step goes through the grad scaler, which skips updates whose gradients are not
finite. Whether it did is left on the device instead of being read on every update, so the step
never waits for the device (with torch's fused optimizers, which skip inside their kernel; the
scaler reads the flag for any other); the scheduler takes back the steps of skipped updates when
it ``settle()``-s (the Trainer does at every log interval).
"""
from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from typing import TYPE_CHECKING, Any, Iterator

import torch

from mmvl.data.sample import DevicePrefetcher, to_device

if TYPE_CHECKING:
    from mmvl.engine.clock import StepClock

log = logging.getLogger("mmvl")


class PreparedOptimizer:
    """Wraps an optimizer so ``step``/``zero_grad`` act only at accumulation boundaries.

    Under fp16 the step goes through the grad scaler, which skips updates whose
    gradients are not finite. Whether it did is left on the device (``skipped``, a
    bool tensor) instead of being read on every update; ``step_was_skipped`` reads
    it (and so waits for the device). Everything else is forwarded to the wrapped
    optimizer.
    """

    def __init__(self, engine: "StepClock", optimizer: torch.optim.Optimizer):
        self.engine = engine
        self.optimizer = optimizer
        #: fp16: True (on the device) when the scaler skipped the last update; None otherwise
        self.skipped: torch.Tensor | None = None
        if engine.scaler is not None and not self.skips_on_device and engine.is_main_process:
            log.info("fp16: the grad scaler reads whether the gradients of %s are finite on every update, a "
                     "host-device sync per update; fused adam_w/adam/sgd under single or ddp skip on the device "
                     "(docs/speed.md)", type(optimizer).__name__)

    def step(self, closure: Any = None) -> None:
        if not self.engine.sync_gradients:
            return
        scaler = self.engine.scaler
        if scaler is None:
            self.optimizer.step(closure)
            return
        # no unscale_ here: the scaler's step does it, inside the kernel for a fused optimizer
        # (unless clip_grad_norm_ already did), and checks the gradients in the same pass
        before = _scale_of(scaler).clone()
        scaler.step(self.optimizer)
        scaler.update()
        # the scaler backs off (lowers its scale) exactly when it skipped the update
        self.skipped = _scale_of(scaler) < before
        self.engine.grads_unscaled = False

    @property
    def step_was_skipped(self) -> bool:
        """Whether the fp16 scaler skipped the last update (waits for the device)."""
        return self.skipped is not None and bool(self.skipped)

    @property
    def skips_on_device(self) -> bool:
        """Whether the fp16 scaler can skip this optimizer's step on the device (torch's fused
        optimizers take its scale and finite flag); otherwise the scaler reads the flag, one
        host-device sync per update."""
        return bool(getattr(self.optimizer, "_step_supports_amp_scaling", False))

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
        if name.startswith("__") or name == "optimizer":  # not set yet (unpickling): no forwarding
            raise AttributeError(name)
        return getattr(self.optimizer, name)


def _scale_of(scaler: Any) -> torch.Tensor:
    """The scaler's current scale as a tensor on its device (no host read)."""
    scale = getattr(scaler, "_scale", None)  # torch's GradScaler keeps it there, updated in place
    return scale if isinstance(scale, torch.Tensor) else torch.tensor(float(scaler.get_scale()))


class PreparedScheduler:
    """Steps the LR schedule once per optimizer update, never per micro-step, and not for
    updates the fp16 scaler skipped.

    Which updates were skipped is known on the device only. Instead of waiting for it on
    every update, the schedule steps at once and is moved back by the number of skipped
    updates when :meth:`settle` reads that count (the Trainer does at every log interval, and
    ``state_dict`` does before a checkpoint). In between, the lr may be ahead by the few updates
    skipped there. A closed-form schedule (``LambdaLR``: all of mmvl's) moves back by its
    position; any other is replayed from its state at the last settle, stepping only for the
    updates that were taken.
    """

    def __init__(self, engine: "StepClock", scheduler: Any):
        self.engine = engine
        self.scheduler = scheduler
        self._skipped: torch.Tensor | None = None  # skipped updates not yet taken back (device)
        self._steps = 0  # steps since the last settle
        self._mark: tuple[dict[str, Any], list[float]] | None = None  # state and lrs at the last settle

    def _times(self) -> int:
        """Schedule steps per update: Accelerate's rule for a script's Engine is one per process
        (each process's batch is a step of the schedule; one with ``split_batches``); the Trainer's
        Engine (from a config, whose schedules count updates) one."""
        engine = self.engine
        if getattr(engine, "scheduler_per_process", False) and not engine.dataloader_config.split_batches:
            return engine.world_size
        return 1

    def _step_schedule(self) -> None:
        total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR raises past its last step
        for _ in range(self._times()):
            if total is None or self.scheduler.last_epoch < total:
                self.scheduler.step()

    def step(self) -> None:
        if not self.engine.sync_gradients:
            if getattr(self.engine, "scheduler_per_process", False) and self.engine.gradient_state.adjust_scheduler:
                self.scheduler._step_count += 1  # a call between optimizer steps, counted as Accelerate does
            return
        optimizer = self.engine.prepared_optimizer
        skipped = getattr(optimizer, "skipped", None)
        if skipped is None:
            self._step_schedule()
            return
        if self._mark is None and not isinstance(self.scheduler, torch.optim.lr_scheduler.LambdaLR):
            lrs = [group["lr"] for group in self.scheduler.optimizer.param_groups]
            self._mark = (copy.deepcopy(self.scheduler.state_dict()), lrs)
        with warnings.catch_warnings():  # torch warns when the scaler skipped the optimizer's step
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
            self._step_schedule()
        self._steps += self._times()
        self._skipped = skipped.int() if self._skipped is None else self._skipped + skipped

    def settle(self) -> None:
        """Take back the steps taken for skipped fp16 updates (reads one number from the device)."""
        if self._skipped is None:
            return
        behind, self._skipped = int(self._skipped.item()) * self._times(), None
        steps, mark, self._steps, self._mark = self._steps, self._mark, 0, None
        if not behind:
            return
        if mark is None:  # closed form: recompute every group's lr at the corrected position
            self.scheduler.last_epoch -= behind + 1
            self.scheduler.step()
            return
        state, lrs = mark  # chainable schedulers compute from the groups' lr: restore those too
        self.scheduler.load_state_dict(state)
        for group, lr in zip(self.scheduler.optimizer.param_groups, lrs):
            group["lr"] = lr
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
            for _ in range(steps - behind):
                self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        self.settle()
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._skipped, self._steps, self._mark = None, 0, None
        self.scheduler.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "scheduler":  # not set yet (unpickling): no forwarding
            raise AttributeError(name)
        return getattr(self.scheduler, name)


class DeviceLoader:
    """Iterates a DataLoader and moves each batch to the device.

    Each ``iter()`` is a new pass over the loader, as with the DataLoader itself. On the CPU the
    batches are the loader's own (not walked through for a move that does nothing). On CUDA with
    ``prefetch`` the next batch is copied on a side stream while the current one computes (pin the
    DataLoader's memory, ``pin_memory=True``, for the copy to overlap).
    """

    def __init__(self, loader: torch.utils.data.DataLoader, device: torch.device, prefetch: bool = True):
        self.loader = loader
        self.device = device
        self.prefetch = prefetch

    def __iter__(self) -> Iterator[Any]:
        if self.prefetch and self.device.type == "cuda":
            yield from DevicePrefetcher(self.loader, self.device)
            return
        if self.device.type == "cpu":  # batches come from host memory: nothing to move (or walk through)
            yield from self.loader
            return
        for batch in self.loader:
            yield to_device(batch, self.device)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "loader":  # not set yet (unpickling): no forwarding
            raise AttributeError(name)
        return getattr(self.loader, name)


@contextlib.contextmanager
def sync_in_backward(model: torch.nn.Module) -> Iterator[None]:
    """The next backward of the DDP ``model`` communicates gradients even after forwards run under
    ``no_sync`` (DDP's reducer is told to expect it); a model without DDP: nothing to do."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        yield
        return
    saved = model.require_backward_grad_sync, model.require_forward_param_sync
    model.require_backward_grad_sync = model.require_forward_param_sync = True
    model.reducer.prepare_for_backward([])
    try:
        yield
    finally:
        model.require_backward_grad_sync, model.require_forward_param_sync = saved


def inner(obj: Any) -> Any:
    """The optimizer/scheduler a PreparedOptimizer/PreparedScheduler wraps (else ``obj``)."""
    if isinstance(obj, PreparedOptimizer):
        return obj.optimizer
    return obj.scheduler if isinstance(obj, PreparedScheduler) else obj


def rebind_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    for group, base_lr in zip(optimizer.param_groups, scheduler.base_lrs):
        group.setdefault("initial_lr", base_lr)
    scheduler.optimizer = optimizer


