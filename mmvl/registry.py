"""One small registry per kind of component.

Each registry maps a name to a class or factory. Registration happens through
explicit imports in each package's ``__init__`` (no directory scanning), and
user code registers the same way from ``env.user_dir``.

Contracts (what the looked-up object is called with, and returns):

- ``MODELS``: ``cls(config: DictConfig)`` where ``config`` is
  ``model_config.<name>``; an ``nn.Module`` whose ``forward(batch: dict)``
  returns a dict with ``scores`` (and optionally ``losses``).
- ``DATASETS``: ``cls(config: DictConfig, data_dir: str)`` with ``config``
  ``dataset_config.<name>``; a :class:`mmvl.data.base.DatasetBuilder`.
- ``PROCESSORS``: ``cls(**params)``; a callable processing one sample field.
- ``LOSSES``: ``cls(**params)``; ``loss(batch, output) -> Tensor`` (scalar).
- ``METRICS``: ``cls(**params)``; a streaming :class:`mmvl.metrics.Metric`. Per
  evaluated split: ``reset()``; ``update(batch, output)`` for every batch, holding
  only the samples this rank owns (``required_keys`` names the batch fields it
  reads, ``output_keys`` the model outputs); ``sync()`` on every rank (a
  collective that combines the ranks' states, so each sample counts once); then
  ``compute() -> dict[str, float]``. States are counts, one value per sample or
  fixed-size summaries, never a samples x classes matrix (declare them with
  ``Metric.add``). A subclass that only implements the earlier whole-set
  ``compute_metric(batch, output)`` still works (its inputs are kept for the
  whole split); so does a plain callable ``metric(data, output)`` with
  ``required_keys``. ``metric(batch, output)`` computes one whole set in-process.
- ``OPTIMIZERS``: ``fn(params, **kwargs) -> torch.optim.Optimizer``; names
  not registered fall back to ``torch.optim.<Name>``.
- ``SCHEDULERS``: ``fn(optimizer, **params) -> LRScheduler``.
- ``TRAINERS``: ``cls(config: DictConfig)`` with ``fit()``/``evaluate()``.
- ``CALLBACKS``: ``cls(trainer, **params)``; a
  :class:`mmvl.trainers.callbacks.base.Callback`.
- ``STRATEGIES``: ``cls(config: DictConfig, env, compute_dtype)``; a
  :class:`mmvl.distributed.strategies.base.Strategy`.
- ``MULTITASKING``: ``fn(sizes: {dataset: samples}, params) -> weights | None`` (``multitasking.type``:
  how the next training batch's dataset is drawn; None: round robin); ``fn.params`` names the
  ``multitasking.params`` it reads.
- ``TRACKERS``: ``cls(project_name, logging_dir, **init_kwargs)``; a
  :class:`mmvl.tracking.base.Tracker` (``training.trackers``, ``Engine(log_with=...)``), made on the
  main process only; it imports its package when made, never at registration.
- ``IMAGE_ENCODERS``: ``cls(**params)``; an ``nn.Module`` turning pixels
  ``B x 3 x H x W`` into a grid ``B x out_dim x h x w`` (``model_config.<model>.image_encoder``).

Every ``{type, params}`` entry of a config is built by
:func:`mmvl.config.components.build_component`.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from mmvl.errors import UserError, did_you_mean


class Registry:
    """A name -> object map for one kind of component."""

    def __init__(self, kind: str, fallback: Callable[[str], Any] | None = None):
        self.kind = kind
        self._items: dict[str, Any] = {}
        self._fallback = fallback

    def register(self, name: str, obj: Any = None):
        """Register ``obj`` under ``name``; usable as a decorator."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"{self.kind} registry: name must be a non-empty string, got {name!r}")

        def _add(o: Any) -> Any:
            if name in self._items:
                raise UserError(
                    f"{self.kind} registry: the name {name!r} is already registered to "
                    f"{_qualname(self._items[name])}; pick another name for {_qualname(o)}."
                )
            self._items[name] = o
            return o

        return _add(obj) if obj is not None else _add

    def get(self, name: str) -> Any:
        if name in self._items:
            return self._items[name]
        if self._fallback is not None:
            found = self._fallback(name)
            if found is not None:
                return found
        names = sorted(self._items)  # listed in full only while short: the error stays one readable line
        known = ", ".join(names) if len(names) <= 5 else f"{len(names)} (`mmvl_run --list {self.kind}`)"
        raise UserError(
            f"Unknown {self.kind} {name!r}.{did_you_mean(name, self._items)} "
            f"Registered {self.kind}{'es' if self.kind.endswith('s') else 's'}: {known or 'none'}. Register yours with "
            f"@registry.register_{self.kind}({name!r}) in a module under env.user_dir."
        )

    def unregister(self, name: str) -> None:
        """Remove ``name`` (tests and interactive sessions re-registering)."""
        self._items.pop(name, None)

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _torch_optimizer(name: str) -> Any:
    import torch.optim

    for candidate in (name, name.replace("_", "")):
        for attr in dir(torch.optim):
            if attr.lower() == candidate.lower():
                obj = getattr(torch.optim, attr)
                if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer):
                    return obj
    return None


MODELS = Registry("model")
DATASETS = Registry("dataset")
PROCESSORS = Registry("processor")
LOSSES = Registry("loss")
METRICS = Registry("metric")
OPTIMIZERS = Registry("optimizer", fallback=_torch_optimizer)
SCHEDULERS = Registry("scheduler")
TRAINERS = Registry("trainer")
CALLBACKS = Registry("callback")
STRATEGIES = Registry("strategy")
IMAGE_ENCODERS = Registry("image_encoder")
MULTITASKING = Registry("multitasking")
TRACKERS = Registry("tracker")

ALL: dict[str, Registry] = {
    r.kind: r
    for r in (MODELS, DATASETS, PROCESSORS, LOSSES, METRICS, OPTIMIZERS, SCHEDULERS,
              TRAINERS, CALLBACKS, STRATEGIES, IMAGE_ENCODERS, MULTITASKING, TRACKERS)
}

register_model = MODELS.register
register_dataset = DATASETS.register
register_builder = DATASETS.register
register_processor = PROCESSORS.register
register_loss = LOSSES.register
register_metric = METRICS.register
register_optimizer = OPTIMIZERS.register
register_scheduler = SCHEDULERS.register
register_trainer = TRAINERS.register
register_callback = CALLBACKS.register
register_strategy = STRATEGIES.register
register_image_encoder = IMAGE_ENCODERS.register
register_multitasking = MULTITASKING.register
register_tracker = TRACKERS.register
