"""``Accelerator`` members the Engine inherits: collectives, triggers, gradients, trackers and
checkpoint folders (process queries: :mod:`mmvl.engine.members`). Each is written on the Engine's own
pieces (its env, strategy, checkpointables and prepared loaders), under Accelerate's name and meaning.
"""
from __future__ import annotations

import contextlib
import gc
import os
from pathlib import Path
from typing import Any, Iterator

import torch

from mmvl import io, tracking
from mmvl.checkpoint import schema
from mmvl.distributed import comm
from mmvl.engine import nested
from mmvl.engine.accelerate import DistributedType
from mmvl.engine.plugins import GradientState
from mmvl.engine.loaders import PreparedLoader, SkippedLoader
from mmvl.engine.members import ProcessMembers
from mmvl.engine.prepared import inner, sync_in_backward
from mmvl.errors import UserError

class AcceleratorMembers(ProcessMembers):
    """Mixed into :class:`mmvl.engine.Engine`; reads ``env``, ``strategy``, ``checkpointables``."""

    env: Any
    strategy: Any
    precision: str
    gradient_accumulation: int
    project_dir: str | None = None
    log_with: list[Any]
    trackers: list[tracking.Tracker]

    gradient_state: GradientState
    _loaders: list[PreparedLoader]

    @property
    def active_loader(self) -> PreparedLoader | None:
        """The prepared loader whose epoch is running (the innermost; gather_for_metrics reads it)."""
        return self.gradient_state.active_dataloader

    def end_training(self) -> None:
        """The trackers flush and close (main process), then every rank meets and leaves the
        process group (as Accelerate does)."""
        from mmvl.distributed.init import destroy

        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
        if comm.is_initialized():
            comm.synchronize()
        destroy()

    # -- collectives -------------------------------------------------------------------
    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """``tensor`` (or a tuple, list, dict of them) summed or averaged over ranks, times ``scale``."""
        return nested.reduce(tensor, reduction, scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """``tensor`` (or each of a tuple, list, dict) padded along ``dim`` to the longest size over ranks."""
        return nested.pad_across_processes(tensor, dim, pad_index, pad_first)

    def gather_for_metrics(self, data: Any, num_samples: int | None = None, use_gather_object: bool = False) -> Any:
        """Every rank's ``data`` joined in the order of the loader's global batch, without the
        samples the prepared loader repeated to even out the ranks (counted from the loader whose
        epoch is running; ``num_samples`` overrides it)."""
        real = num_samples
        if real is None and self.active_loader is not None:
            real = self.active_loader.real_in_batch
        if use_gather_object:
            parts = nested.gather_object(data if isinstance(data, (list, tuple)) else [data])
            return parts if real is None else parts[:real]
        return nested.gather_for_metrics(data, real)

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: list[Any], even_batches: bool | None = None) -> Iterator[None]:
        """Let ranks with fewer batches finish while the others run their last ones (torch's
        ``Join`` over the DDP models in ``joinables``, when the loaders are not even); ``even_batches``
        overrides the prepared loaders' setting inside the block (map-style loaders only)."""
        import warnings

        from torch.distributed.algorithms.join import Join

        loaders = list(self._loaders)
        saved = []
        if even_batches is not None:
            if any(loader.iterable for loader in loaders):
                warnings.warn("join_uneven_inputs(even_batches=...) is only supported for map-style datasets; "
                              "the iterable loaders keep their setting.", UserWarning, stacklevel=3)
            for loader in loaders:
                if not loader.iterable:
                    saved.append((loader, loader.shard.even_batches))
                    loader.shard.even_batches = even_batches
        try:
            if self.distributed_type in (DistributedType.MULTI_GPU, DistributedType.MULTI_CPU):
                ddp = [j for j in joinables if isinstance(j, torch.nn.parallel.DistributedDataParallel)]
                even = self.dataloader_config.even_batches if even_batches is None else even_batches
                # even loaders need no joining (every rank runs as many steps): Join's per-step check is skipped
                with Join(ddp, enable=not even, throw_on_early_termination=False) if ddp else contextlib.nullcontext():
                    yield
            else:
                if self.distributed_type != DistributedType.NO:
                    warnings.warn("join_uneven_inputs is only supported for multi-GPU/multi-CPU data parallelism "
                                  f"(this run: {self.distributed_type.value}); the block runs as is.", UserWarning,
                                  stacklevel=3)
                yield
        finally:
            for loader, even in saved:
                loader.shard.even_batches = even

    # -- triggers, gradients ---------------------------------------------------------
    def set_trigger(self) -> None:
        """Raise this rank's flag; :meth:`check_trigger` on every rank sees it."""
        self._trigger = torch.ones(1, device=self.env.device)

    def check_trigger(self) -> bool:
        """Whether any rank called :meth:`set_trigger` since the last check (a collective)."""
        flag = getattr(self, "_trigger", None)
        flag = torch.zeros(1, device=self.env.device) if flag is None else flag
        raised = bool(comm.all_reduce(flag).item() > 0)
        self._trigger = None
        return raised

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Clip each gradient to [-clip_value, clip_value] at the boundary (unscaled first under fp16)."""
        if not self.sync_gradients:
            return
        self._unscale()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the fp16 scaler skipped the last update (reads the device)."""
        opt = self.prepared_optimizer
        return bool(opt is not None and opt.step_was_skipped)

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Gradients of the block are not communicated (the strategy's ``no_sync``)."""
        return self.strategy.no_sync(model)

    def trigger_sync_in_backward(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """The block's backward communicates gradients though earlier forwards ran under ``no_sync``."""
        return sync_in_backward(model)

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> SkippedLoader:
        """The prepared ``dataloader``'s epoch from batch ``num_batches`` on (after ``load_state``,
        the restored epoch: skipping the restored count lands where the loader already is)."""
        if not isinstance(dataloader, PreparedLoader):
            raise UserError("skip_first_batches(dataloader, n) takes a loader returned by prepare(); "
                            f"got {type(dataloader).__name__}. Pass it through prepare() first.")
        return SkippedLoader(dataloader, num_batches)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Under fp16, divide the gradients by the loss scale now (once an update; clipping does it
        itself); nothing to do in other precisions."""
        self._unscale()

    def clear(self, *objects: Any) -> list[None]:
        """Accelerate's other name for :meth:`free_memory`."""
        return self.free_memory(*objects)

    def free_memory(self, *objects: Any) -> list[None]:
        """Forget what ``prepare`` saw (so a retry prepares afresh) and release cached memory."""
        self._prepared.clear()
        for name in [schema.MODEL, schema.SCHEDULER, *self._loader_names]:
            self.checkpointables.unregister(name)
        self._loader_names, self._loaders, self._micro_step = [], [], 0
        self.gradient_state.dataloader_references.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return [None for _ in objects]

    # -- checkpoints -------------------------------------------------------------
    def register_for_checkpointing(self, *objects: Any) -> None:
        """Add objects with ``state_dict``/``load_state_dict`` to :meth:`save_state`."""
        bad = [f"#{i} ({type(o).__name__})" for i, o in enumerate(objects)
               if not (callable(getattr(o, "state_dict", None)) and callable(getattr(o, "load_state_dict", None)))]
        if bad:
            raise UserError(f"register_for_checkpointing: {', '.join(bad)} have no state_dict()/load_state_dict(); "
                            "register objects that have both.")
        for obj in objects:
            index = 0
            while schema.custom_name(index) in self.checkpointables:
                index += 1
            self.checkpointables.register(schema.custom_name(index), obj)

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """The model's full state dict (gathered when sharded; every rank calls it)."""
        return self.strategy.model_state_dict(model)

    def save(self, obj: Any, f: str | os.PathLike[str], safe_serialization: bool = False) -> None:
        """Write ``obj`` to ``f`` once (main process), atomically; safetensors with ``safe_serialization``."""
        if not self.is_main_process:
            return
        if safe_serialization:
            from safetensors.torch import save as to_bytes

            io.atomic_write(f, "wb", lambda out: out.write(to_bytes({k: v.contiguous() for k, v in obj.items()})))
        else:
            io.atomic_save(obj, f)

    def save_state(self, output_dir: str | os.PathLike[str] | None = None, **_: Any) -> str:
        """Write every checkpointable (model, optimizer, scaler, scheduler, RNG, loaders' positions,
        what was registered) into the folder ``output_dir``, published complete or not at all."""
        target = Path(self._state_dir(output_dir, new=True))
        state = self.state_dict()  # a collective: every rank takes part

        def write() -> None:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = io.make_temp_dir(target.parent)
            io.atomic_save(state, tmp / schema.ENGINE_STATE)
            if target.exists():
                io.remove_tree(target)
            io.publish_dir(tmp, target)

        comm.on_main_agreed(write, f"save the state to {target}")
        return str(target)

    def load_state(self, input_dir: str | os.PathLike[str] | None = None, **_: Any) -> None:
        """Restore what :meth:`save_state` wrote: loaders continue mid-epoch where they stopped."""
        source = Path(self._state_dir(input_dir, new=False))
        problem = io.completeness_problem(source) if source.is_dir() else "it is not a folder"
        if problem is not None:  # on any rank: every rank raises (none waits in load_state_dict's collectives)
            problem = (f"load_state({str(source)!r}): not a complete save_state folder ({problem}); pass a folder "
                       "save_state wrote (on a file system every process sees).")
        comm.all_ranks_agreed(problem, "load the state")
        self.load_state_dict(io.safe_load(source / schema.ENGINE_STATE, expect_keys=(schema.FORMAT,)))

    def _state_dir(self, directory: str | os.PathLike[str] | None, new: bool) -> str | os.PathLike[str]:
        """``directory``, or with ``project_dir`` the next (saving) / latest (loading) checkpoint of it."""
        if directory is not None:
            return directory
        if self.project_dir is None:
            raise UserError("save_state()/load_state() without a folder need Engine(project_dir=...); "
                            "or pass the folder: save_state('checkpoints/step_100').")
        root = Path(self.project_dir) / "checkpoints"
        done = sorted((int(p.name.split("_")[1]) for p in root.glob("checkpoint_*")
                       if p.name.split("_")[1].isdigit()), reverse=True) if root.is_dir() else []
        if not new and not done:
            raise UserError(f"load_state(): {root} holds no checkpoint_<n> folder; save_state() first.")
        return root / f"checkpoint_{(done[0] + 1) if new and done else (0 if new else done[0])}"

    def _unscale(self) -> None:
        if self.scaler is not None and not self.grads_unscaled:
            self.scaler.unscale_(inner(self.prepared_optimizer))
            self.grads_unscaled = True

    # -- trackers ------------------------------------------------------------------------
    def init_trackers(self, project_name: str, config: dict[str, Any] | None = None,
                      init_kwargs: dict[str, dict[str, Any]] | None = None) -> None:
        """Start a run of every ``log_with`` tracker on the main process, files under ``project_dir``
        (else the working folder); ``config`` is recorded as the run's hyperparameters."""
        if not self.is_main_process:
            return
        self.trackers = tracking.start(self.log_with, project_name, self.project_dir or ".", init_kwargs)
        if config is not None:
            for tracker in self.trackers:
                tracker.store_init_configuration(config)

    def log(self, values: dict[str, Any], step: int | None = None) -> None:
        """Log ``values`` (numbers, one-element tensors, texts, mappings of numbers) to every tracker
        (main process only; elsewhere nothing is read from the device)."""
        if not self.trackers:
            return
        plain = {k: v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v for k, v in values.items()}
        for tracker in self.trackers:
            tracker.log(plain, step)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker ``name`` (``unwrap``: its backend's own object); None off the main process."""
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        if not self.is_main_process:
            return None
        started = ", ".join(t.name for t in self.trackers) or "none (call init_trackers first)"
        raise UserError(f"get_tracker({name!r}): no such tracker was started; started: {started}.")


__all__ = ["AcceleratorMembers"]
