"""Accelerate's configuration objects under the same names and fields, and the gradient state.

``DataLoaderConfiguration`` says how ``prepare`` shards a DataLoader, ``GradientAccumulationPlugin``
how ``accumulate`` counts micro-steps, and :class:`GradientState` is what the prepared loaders and
``accumulate`` share while a loop runs (which loader is iterating, whether its last batch is out,
whether this micro-step syncs). A user may pass Accelerate's own objects: they are read by their
fields (this module imports nothing of Accelerate). A leaf: it imports nothing of the Engine.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from mmvl.errors import UserError


@dataclasses.dataclass
class DataLoaderConfiguration:
    """How ``prepare`` shards a DataLoader between the processes.

    - ``split_batches``: the loader's batch is the *global* batch; each process takes its
      ``1/num_processes`` part (the batch size must divide by the number of processes). Otherwise
      each process takes whole batches, so one step's batches together are ``num_processes`` of
      the loader's batches (a run at N processes of batch B equals one process of batch N*B);
    - ``dispatch_batches``: Accelerate reads every batch on the main process and sends the parts;
      mmvl's processes each read their own part of the same order, which yields the same batches
      (accepted; the data are read where they are used);
    - ``even_batches``: the end of an epoch is filled from its start so every process runs as many
      steps, each batch full (``gather_for_metrics`` drops the repeated samples); ``False``: the
      last steps may be shorter or missing on some processes (see ``join_uneven_inputs``);
    - ``use_seedable_sampler``: a shuffling sampler draws epoch ``e``'s order from the seed
      ``data_seed`` (else the run's seed) plus ``e``, so an epoch's order is reproducible from its
      number alone (``loader.set_epoch(e)``);
    - ``data_seed``: that seed;
    - ``use_stateful_dataloader``: the prepared loader's ``state_dict()``/``load_state_dict()``
      (mmvl's loaders always have them; the flag is accepted for Accelerate's scripts).
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False


@dataclasses.dataclass
class GradientAccumulationPlugin:
    """How ``accumulate`` counts micro-steps.

    - ``num_steps``: micro-batches per optimizer update (``gradient_accumulation_steps``);
    - ``adjust_scheduler``: the prepared scheduler counts the skipped micro-steps as calls (so
      torch's order check between optimizer and scheduler steps stays quiet); its schedule does
      not move;
    - ``sync_with_dataloader``: the last batch of an epoch ends an update even mid-group;
    - ``sync_each_batch``: gradients are communicated on every micro-step (less memory under
      data parallelism, same result); the optimizer still steps every ``num_steps``.
    """

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


def _fields(obj: Any, cls: type, what: str) -> Any:
    """``obj`` as ``cls``: None gives the defaults; another object is read by ``cls``'s fields."""
    if obj is None:
        return cls()
    if isinstance(obj, cls):
        return obj
    if isinstance(obj, dict):
        unknown = sorted(set(obj) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise UserError(f"{what}: unknown fields {unknown}; the fields are "
                            f"{[f.name for f in dataclasses.fields(cls)]}.")
        return cls(**obj)
    names = [f.name for f in dataclasses.fields(cls)]
    if not any(hasattr(obj, n) for n in names):
        raise UserError(f"{what}={obj!r} has none of the fields {names}; pass a {cls.__name__}.")
    return cls(**{n: getattr(obj, n) for n in names if hasattr(obj, n)})


def dataloader_configuration(obj: Any) -> DataLoaderConfiguration:
    """mmvl's :class:`DataLoaderConfiguration` from ours, Accelerate's, a dict or None."""
    config = _fields(obj, DataLoaderConfiguration, "dataloader_config")
    if config.data_seed is not None and not isinstance(config.data_seed, int):
        raise UserError(f"dataloader_config.data_seed={config.data_seed!r} is not a whole number.")
    return config


def accumulation_plugin(obj: Any) -> GradientAccumulationPlugin | None:
    """mmvl's :class:`GradientAccumulationPlugin` from ours, Accelerate's, a dict, or None (none given)."""
    if obj is None:
        return None
    plugin = _fields(obj, GradientAccumulationPlugin, "gradient_accumulation_plugin")
    if plugin.num_steps is None or int(plugin.num_steps) < 1:
        raise UserError(f"GradientAccumulationPlugin(num_steps={plugin.num_steps!r}): num_steps must be >= 1.")
    return plugin


def plugin_steps(plugin: GradientAccumulationPlugin | None, steps: int | None) -> int | None:
    """The accumulation steps of ``gradient_accumulation_steps`` and the plugin's ``num_steps`` (one setting)."""
    if plugin is None:
        return steps
    if steps is not None and int(steps) != int(plugin.num_steps):
        raise UserError(f"Engine(gradient_accumulation_steps={steps}, gradient_accumulation_plugin.num_steps="
                        f"{plugin.num_steps}) name one setting twice; pass one of them.")
    return int(plugin.num_steps)


class GradientState:
    """What the prepared loaders and ``accumulate`` share while a loop runs (Accelerate's names).

    Loaders push themselves when an epoch starts and pop when it ends (or the loop is left), so in
    nested loops the innermost running loader is the active one.
    """

    def __init__(self, plugin: GradientAccumulationPlugin | None = None):
        plugin = plugin or GradientAccumulationPlugin()
        self.plugin_kwargs = dataclasses.asdict(plugin)
        self.adjust_scheduler = plugin.adjust_scheduler
        self.sync_with_dataloader = plugin.sync_with_dataloader
        self.sync_each_batch = plugin.sync_each_batch
        #: this micro-step ends an update: gradients are communicated, the optimizer steps
        self.sync_gradients = True
        self.dataloader_references: list[Any] = []

    @property
    def active_dataloader(self) -> Any:
        """The prepared loader whose epoch is running (the innermost), or None."""
        return self.dataloader_references[-1] if self.dataloader_references else None

    @property
    def in_dataloader(self) -> bool:
        return bool(self.dataloader_references)

    @property
    def end_of_dataloader(self) -> bool:
        """The active loader just yielded its epoch's last batch."""
        loader = self.active_dataloader
        return bool(loader is not None and loader.end_of_epoch)

    @property
    def remainder(self) -> int:
        """Samples of the active loader's last global batch that repeat earlier ones (else -1)."""
        loader = self.active_dataloader
        if loader is None or not loader.end_of_epoch or loader.real_in_batch is None:
            return -1
        return int(loader.real_in_batch)

    @classmethod
    def _reset_state(cls) -> None:
        """Accelerate clears its process-wide gradient state here; mmvl has none to clear (each
        Engine owns its own), so nothing is left over from an earlier Engine."""

    def _add_dataloader(self, loader: Any) -> None:
        self.dataloader_references.append(loader)

    def _remove_dataloader(self, loader: Any) -> None:
        for i in range(len(self.dataloader_references) - 1, -1, -1):
            if self.dataloader_references[i] is loader:
                del self.dataloader_references[i]
                return


__all__ = ["DataLoaderConfiguration", "GradientAccumulationPlugin", "GradientState", "accumulation_plugin",
           "dataloader_configuration"]
