"""FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and optimizer state sharded.

``model.shard_units()`` (e.g. transformer layers) are sharded one by one, then
the root. Parameters become DTensors, so the optimizer is rebuilt on them.
Full checkpoints use the plain torch format (integer-indexed optimizer state),
so they load under any strategy and world size; the sharded form (each rank's
part, through ``torch.distributed.checkpoint`` in the base class) re-shards on load.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch

from mmvl.distributed.strategies.base import Strategy
from mmvl.errors import UserError
from mmvl.registry import register_strategy
from mmvl.utils.activation_checkpointing import checkpoint_each

log = logging.getLogger("mmvl")


def _state_options(full: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True) if full else StateDictOptions()


def _param_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _index_form(state: dict[str, Any]) -> dict[str, Any]:
    """FQN-keyed optimizer state -> torch's integer-indexed form (indices in param-group order)."""
    index: dict[str, int] = {}
    groups = []
    for group in state["param_groups"]:
        ids = [index.setdefault(fqn, len(index)) for fqn in group["params"]]
        groups.append({**group, "params": ids})
    return {"state": {index[fqn]: value for fqn, value in state["state"].items()}, "param_groups": groups}


def _fqn_form(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              state: dict[str, Any]) -> dict[str, Any]:
    """Integer-indexed optimizer state -> FQN keys, following this optimizer's parameter order."""
    names = _param_names(model)
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    saved = sum(len(g["params"]) for g in state["param_groups"])
    if len(order) != saved:
        raise UserError(f"The checkpoint's optimizer state covers {saved} parameters but this model's "
                        f"optimizer has {len(order)}; resume with the same model and optimizer config.")

    def fqn(key: Any) -> str:
        return key if isinstance(key, str) else order[key]

    return {"state": {fqn(k): v for k, v in state["state"].items()},
            "param_groups": [{**g, "params": [fqn(k) for k in g["params"]]} for g in state["param_groups"]]}


@register_strategy("fsdp")
class FSDPStrategy(Strategy):
    """Fully sharded data parallel (FSDP2) with optional mixed precision and activation checkpointing."""

    name = "fsdp"
    needs_process_group = True
    handles_gradient_checkpointing = True
    shards_optimizer_state = True
    shards_parameters = True
    full_gradients = False
    communicates_in_backward = True

    def wrap(self, model, optimizer):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        dtype = self.compute_dtype  # the Engine's autocast dtype: parameters are gathered in it
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
        mesh = init_device_mesh(self.env.device.type, (self.env.world_size,))
        units = list(model.shard_units()) if hasattr(model, "shard_units") else []
        if hasattr(model, "every_part_each_forward"):  # every unit's gather must meet on every rank, every forward
            model.every_part_each_forward = True
        if self.training.gradient_checkpointing:
            self._checkpoint_activations(model, units)
        reshard = bool(self.distributed.reshard_after_forward)
        old_names = _param_names(model)
        for unit in units:
            fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        # the root's parameters are needed again right at the start of backward: keep them
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
        if optimizer is not None:
            optimizer = self._rebuild_optimizer(model, optimizer, old_names)
        return model, optimizer

    @staticmethod
    def _checkpoint_activations(model: torch.nn.Module, units: list[torch.nn.Module]) -> None:
        """Recompute each shard unit's activations in backward (the model's own switch without units)."""
        if units:
            checkpoint_each(units)
        elif hasattr(model, "enable_gradient_checkpointing"):
            model.enable_gradient_checkpointing()

    def _rebuild_optimizer(self, model, optimizer, old_names: dict[int, str]):
        """The same optimizer class and groups, on the DTensor parameters that replaced the originals."""
        if any(id(p) not in old_names for g in optimizer.param_groups for p in g["params"]):
            raise UserError("The optimizer holds parameters that are not in the model; "
                            "build the optimizer from model.parameters() before fsdp wraps it.")
        new_params = dict(model.named_parameters())
        remap = {id_: new_params[name] for id_, name in old_names.items()}
        groups, defaults = self.param_groups(optimizer, remap), self.optimizer_defaults(optimizer)
        if not isinstance(optimizer, torch.optim.Adam):  # AdamW too: DTensors have no other fused kernel
            for options in (defaults, *groups):
                if options.get("fused"):
                    options["fused"] = False
                    self._log_unfused(type(optimizer).__name__)
        return type(optimizer)(groups, **defaults)

    def _log_unfused(self, name: str) -> None:
        if self.env.is_main_process and not getattr(self, "_said_unfused", False):
            self._said_unfused = True
            log.info("fsdp: %s runs unfused (torch has no fused %s kernel for sharded DTensor parameters); under "
                     "fp16 the grad scaler reads its finite-gradient flag every update", name, name)

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def clip_grad_norm_(self, model, optimizer, max_norm: float) -> torch.Tensor:
        """Clip with the norm over all shards; returns it as a plain (replicated) tensor."""
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    # -- full (portable) state: collectives, call on every rank --------------------------------
    def model_state_dict(self, model) -> dict[str, Any]:
        """Full model state on rank 0 (CPU); ``{}`` on the others."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model, options=_state_options(full=True))

    def load_model_state_dict(self, model, state) -> None:
        """Load a full state dict given on every rank; each rank keeps its shard."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, dict(state), options=StateDictOptions(full_state_dict=True))

    def optimizer_state_dict(self, model, optimizer) -> dict[str, Any]:
        """Full optimizer state in torch's integer-indexed form on rank 0; ``{}`` on the others."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        state = get_optimizer_state_dict(model, optimizer, options=_state_options(full=True))
        return _index_form(state) if self.env.rank == 0 else {}

    def load_optimizer_state_dict(self, model, optimizer, state) -> None:
        """Load a full optimizer state (integer- or FQN-keyed) given on every rank. A trainable
        parameter that never had a gradient (LLaVA's vision layers after the one it reads) had no
        optimizer state when it was saved and gets none now (``strict=False``, then the state torch
        initialised for it dropped), as in the run that went on; the parameters themselves are
        counted against the checkpoint's first."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        named = _fqn_form(model, optimizer, state)
        set_optimizer_state_dict(model, optimizer, named, options=StateDictOptions(full_state_dict=True, strict=False))
        names = _param_names(model)
        for group in optimizer.param_groups:  # torch initialises every parameter's state first: undo it for those
            for p in group["params"]:  # the checkpoint holds none for, so the run goes on as the saved one would
                if names[id(p)] not in named["state"]:
                    optimizer.state.pop(p, None)

    @contextlib.contextmanager
    def decoding(self, model: torch.nn.Module) -> Iterator[None]:
        """The root's own parameters gathered while ``generate`` runs: it calls the shard units'
        forwards (their hooks gather their parameters, step by step on every rank) but not the root's
        (the embeddings, an image encoder, a projector, the LM head are the root group's)."""
        from torch.distributed.fsdp import FSDPModule

        root = model if isinstance(model, FSDPModule) else None
        if root is not None:
            root.unshard()
        try:
            yield
        finally:
            if root is not None:
                root.reshard()

    # -- sharded state: each rank writes/reads its own part -----------------------------------
    @property
    def sharded_checkpoint(self) -> bool:
        return bool(self.distributed.sharded_checkpoint)
