"""The strategy contract: how a model and its optimizer are spread over devices.

The Engine picks one strategy from ``distributed.strategy`` and calls only
these methods; the Trainer never looks inside. At world size 1 every strategy
must leave the model unchanged in behaviour.
"""
from __future__ import annotations

import contextlib
import inspect
import warnings
from typing import Any, Iterator

import torch
from omegaconf import DictConfig

from mmvl.distributed.env import DistEnv
from mmvl.config.schema import typed_section




class Strategy:
    """Base strategy: one process, one device, nothing wrapped."""

    name = "single"
    #: needs an initialised process group (``build_strategy`` refuses it in a run of one process)
    needs_process_group = False
    #: applies activation checkpointing itself (the engine then skips ``model.enable_gradient_checkpointing``)
    handles_gradient_checkpointing = False
    #: splits the optimizer state over ranks (what ``optimizer.enable_state_sharding`` asks for)
    shards_optimizer_state = False
    # What callers may ask instead of reading a strategy's name (a registered strategy of a user's
    # own says what it can do here, and the Engine, evaluation and callbacks follow):
    #: each rank holds a shard of every parameter, so no rank can run the model alone: no decoding
    #: per rank, no calls into the model's encoders, no full copy for an EMA
    shards_parameters = False
    #: after backward every rank holds the whole reduced gradient, so any subset of parameters can
    #: be clipped locally (otherwise the strategy clips the whole prepared model itself)
    full_gradients = True
    #: one process drives several devices (DataParallel): replicas share one forward, which
    #: ``torch.compile`` cannot give each of them; Accelerate counts it as multi-device
    replicas_in_one_process = False
    #: gradients are communicated while backward runs (DDP's buckets, FSDP's per-unit reduce), so
    #: ``training.compile`` compiles each of the model's ``shard_units()`` to keep that overlap
    communicates_in_backward = False

    def __init__(self, config: DictConfig | Any, env: DistEnv, compute_dtype: torch.dtype | None = None):
        """``config``: a loaded config or the Engine's sections (anything
        :func:`mmvl.config.schema.typed_section` reads); ``compute_dtype``: the Engine's autocast dtype
        (None: fp32), for strategies whose parameters follow it (FSDP's mixed-precision policy)."""
        self.env = env
        self.compute_dtype = compute_dtype
        #: the typed ``distributed`` and ``training`` sections the strategies read
        self.distributed = typed_section(config, "distributed")
        self.training = typed_section(config, "training")

    def decoding(self, model: torch.nn.Module) -> Any:
        """A context in which the model's ``generate`` may run outside its ``forward`` (this default:
        nothing to do; a strategy that shards parameters gathers those its forward hooks would not)."""
        return contextlib.nullcontext()

    # -- set-up -----------------------------------------------------------
    def wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
             ) -> tuple[torch.nn.Module, torch.optim.Optimizer | None]:
        """Wrap/shard ``model`` (already on ``env.device``) and rebuild ``optimizer`` if needed.

        A strategy that replaces parameters (FSDP) or shards optimizer state
        (ZeRO) builds the new optimizer from ``type(optimizer)``, its
        ``param_groups`` and ``defaults``.
        """
        return model, optimizer

    @staticmethod
    def param_groups(optimizer: torch.optim.Optimizer,
                     remap: dict[int, torch.nn.Parameter] | None = None) -> list[dict[str, Any]]:
        """``optimizer``'s groups as constructor input, hyper-parameters kept.

        ``remap`` maps ``id(old_param)`` to the parameter that replaces it
        (FSDP swaps parameters for sharded ones).
        """
        groups = []
        for group in optimizer.param_groups:
            params = [remap[id(p)] if remap is not None else p for p in group["params"]]
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
        return groups

    @staticmethod
    def optimizer_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer.defaults`` restricted to what its constructor accepts.

        (``AdamW.defaults`` holds ``decoupled_weight_decay``, which ``AdamW()`` rejects.)
        """
        params = inspect.signature(type(optimizer).__init__).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return dict(optimizer.defaults)
        return {k: v for k, v in optimizer.defaults.items() if k in params}

    def make_grad_scaler(self, enabled: bool) -> Any:
        """The fp16 loss scaler for this strategy (``None`` when disabled)."""
        if not enabled:
            return None
        return torch.amp.GradScaler(self.env.device.type)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    # -- per step ---------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """Context for non-boundary micro-steps: skip gradient communication."""
        yield

    def clip_grad_norm_(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        max_norm: float) -> torch.Tensor:
        """Clip and return the *global* gradient norm (over all shards/ranks)."""
        params = [p for p in model.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    # -- state --------------------------------------------------------------
    # Sharded strategies gather or scatter inside these: call them on EVERY rank.
    # Saving returns the complete state on rank 0; loading takes the full state on every rank.
    # The format is the plain torch one for every strategy, so checkpoints move between
    # strategies and world sizes.
    def model_state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        """Full (unsharded) model state, valid on rank 0 at least."""
        return self.unwrap(model).state_dict()

    def load_model_state_dict(self, model: torch.nn.Module, state: dict[str, Any]) -> None:
        """Load a full state whose keys are the unwrapped model's own (the Engine matches a
        checkpoint's keys to the model, and names mismatches, before it calls this)."""
        self.unwrap(model).load_state_dict(state)

    def optimizer_state_dict(self, model: torch.nn.Module,
                             optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Full optimizer state (consolidated on rank 0 for sharded optimizers)."""
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                                  state: dict[str, Any]) -> None:
        """Load a full optimizer state, re-sharding it if this strategy shards."""
        optimizer.load_state_dict(state)

    @property
    def sharded_checkpoint(self) -> bool:
        """True when each rank writes its own part of a checkpoint (``save_sharded_state``)."""
        return False

    # Sharded state: each rank's own part of the model and optimizer state dicts, written and
    # read through torch.distributed.checkpoint (DCP). Where the directory is and when it counts
    # as complete (the marker, the rest of the checkpoint) is the checkpoint package's business.
    def _dcp_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        module = self.unwrap(model)
        state = {"model": get_model_state_dict(module)}
        if optimizer is not None:
            state["optimizer"] = get_optimizer_state_dict(module, optimizer)
        return state

    def save_sharded_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                           directory: str) -> None:
        """Every rank writes its part of the model (and optimizer) state into ``directory`` (DCP;
        a collective when a process group is up). Replicated state is written once."""
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():  # one process without a group is intended here, not a mistake
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(self._dcp_state(model, optimizer), checkpoint_id=directory)

    def can_load_sharded(self, optimizer: torch.optim.Optimizer | None) -> bool:
        """Whether :meth:`load_sharded_state` works here: DCP needs torch's own optimizer state
        format, which the ZeRO optimizers (their own ``state_dict``) do not have."""
        return optimizer is None or type(optimizer).state_dict is torch.optim.Optimizer.state_dict

    def load_sharded_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                           directory: str) -> None:
        """Every rank reads the parts it needs (DCP re-shards: any world size, FSDP or replicated);
        ``optimizer=None`` loads the model only. A collective when a process group is up."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        from mmvl.errors import UserError

        if not self.can_load_sharded(optimizer):
            raise UserError(f"checkpoint {directory!r} is sharded (DCP) and distributed.strategy={self.name} "
                            "cannot load it; resume it with distributed.strategy=fsdp, ddp or single.")
        module = self.unwrap(model)
        state = self._dcp_state(model, optimizer)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=directory)
        set_model_state_dict(module, state["model"])
        if optimizer is not None:
            set_optimizer_state_dict(module, optimizer, state["optimizer"])
