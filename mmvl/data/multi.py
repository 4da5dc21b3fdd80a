"""Training on several datasets at once: one batch per step, from one dataset.

``MultiStream`` wraps one :class:`~mmvl.data.loaders.TrainStream` per dataset and,
at every ``next()``, draws which dataset gives the batch. The strategy comes from
the ``multitasking`` config::

    multitasking:
      type: size_proportional   # or round_robin, ratios, temperature
      params: {}                # sampling_ratios: {vqa2: 2, coco: 1} / temperature: 2.0

Why every rank draws the same dataset without talking to the others: the draw
uses a private CPU ``torch.Generator`` seeded only from the run's seed, and the
strategy's weights come from the full dataset sizes (the same on every rank), so
each rank's generator advances identically, one draw per ``next()``. Ranks must
agree - under DDP/FSDP a step where ranks run different heads would reduce
mismatched gradients or hang. The generator is private so that nothing else
(augmentations, dropout, per-rank seeding) can move it out of step.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Protocol

import torch
from omegaconf import DictConfig

from mmvl.config.access import plain_dict
from mmvl.errors import UserError, did_you_mean
from mmvl.registry import MULTITASKING, register_multitasking

#: mixed into the seed so the draws are not correlated with samplers seeded from ``seed``
_SEED_SALT = 0x6D756C7469  # "multi"


class Stream(Protocol):
    """What MultiStream needs from a per-dataset stream (TrainStream has all of it)."""

    dataset: Any
    batches_per_epoch: int
    epoch: int

    def __next__(self) -> Any: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# -- strategies ----------------------------------------------------------------
# A strategy maps (dataset sizes by name, params) to per-dataset weights; ``None``
# means "no randomness": take the datasets in turn.
StrategyFn = Callable[[dict[str, int], dict[str, Any]], "list[float] | None"]


def sampling(name: str, params: tuple[str, ...]) -> Callable[[StrategyFn], StrategyFn]:
    """Register a multitasking sampling strategy reading ``multitasking.params`` ``params``."""
    def add(fn: StrategyFn) -> StrategyFn:
        fn.params = params  # type: ignore[attr-defined]
        return register_multitasking(name)(fn)

    return add


@sampling("size_proportional", ())
def _size_proportional(sizes: dict[str, int], params: dict[str, Any]) -> list[float]:
    """Each sample seen about equally often: P(dataset) ~ its size."""
    return [float(s) for s in sizes.values()]


@sampling("round_robin", ())
def _round_robin(sizes: dict[str, int], params: dict[str, Any]) -> None:
    """Datasets in config order, one batch each, repeating."""
    return None


@sampling("ratios", ("sampling_ratios",))
def _ratios(sizes: dict[str, int], params: dict[str, Any]) -> list[float]:
    """Fixed user weights: ``params.sampling_ratios: {name: weight}``."""
    key = "multitasking.params.sampling_ratios"
    ratios = params.get("sampling_ratios")
    if not isinstance(ratios, Mapping) or not ratios:
        raise UserError(f"{key} must map each dataset to a positive weight for type=ratios, got "
                        f"{ratios!r}; e.g. {key}={{{', '.join(f'{n}: 1' for n in sizes)}}}.")
    for name in ratios:
        if name not in sizes:
            raise UserError(f"{key}.{name} names no chosen dataset (chosen: {', '.join(sizes)})."
                            + did_you_mean(str(name), sizes))
    weights = []
    for name in sizes:
        if name not in ratios:
            raise UserError(f"{key} has no weight for dataset {name!r}; add {key}.{name}=<weight>.")
        value = ratios[name]
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or value <= 0:
            raise UserError(f"{key}.{name}={value!r} must be a positive number.")
        weights.append(float(value))
    return weights


@sampling("temperature", ("temperature",))
def _temperature(sizes: dict[str, int], params: dict[str, Any]) -> list[float]:
    """P ~ size^(1/T): T=1 is size-proportional, large T tends to uniform."""
    key = "multitasking.params.temperature"
    t = params.get("temperature")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
        raise UserError(f"{key}={t!r} must be a positive number for type=temperature "
                        f"(e.g. {key}=2.0; 1.0 is size-proportional).")
    logs = [math.log(s) / float(t) for s in sizes.values()]
    top = max(logs)
    return [math.exp(v - top) for v in logs]  # shifted: no overflow for huge sizes / small T


DEFAULT_STRATEGY = "size_proportional"


def resolve_strategy(config: DictConfig | Mapping[str, Any] | None,
                     sizes: dict[str, int]) -> tuple[str, list[float] | None]:
    """Validate the ``multitasking`` config; return (strategy name, normalized probabilities)."""
    cfg = plain_dict(config)
    name = cfg.get("type") or DEFAULT_STRATEGY
    if name not in MULTITASKING:
        raise UserError(f"multitasking.type={name!r} is not a sampling strategy; choose one of "
                        f"{', '.join(MULTITASKING.names())}." + did_you_mean(str(name), MULTITASKING.names()))
    params = cfg.get("params") or {}
    if not isinstance(params, Mapping):
        raise UserError(f"multitasking.params must be a mapping, got {params!r}.")
    known = {p for n in MULTITASKING.names() for p in getattr(MULTITASKING.get(n), "params", ())}
    for key in params:  # params of another strategy are ignored, typos are not
        if key not in known:
            raise UserError(f"multitasking.params.{key} is not a sampling parameter (known: "
                            f"{', '.join(sorted(known))})." + did_you_mean(str(key), known))
    fn = MULTITASKING.get(name)
    weights = fn(sizes, dict(params))
    if weights is None:
        return name, None
    total = sum(weights)
    return name, [w / total for w in weights]


# -- the stream ----------------------------------------------------------------
class MultiStream:
    """An endless stream of batches drawn from several datasets' streams.

    Each batch is the chosen stream's batch dict with ``dataset_name`` set, so
    the model and losses can pick the right head. Round robin takes datasets in
    the order of ``streams``.
    """

    def __init__(self, streams: dict[str, Stream],
                 config: DictConfig | Mapping[str, Any] | None, seed: int):
        if not streams:
            raise UserError("MultiStream needs at least one dataset; set datasets=<name>[,<name>].")
        self.streams = dict(streams)
        self.names = list(self.streams)
        self.sizes = {n: len(s.dataset) for n, s in self.streams.items()}
        for n, size in self.sizes.items():
            if size <= 0:
                raise UserError(f"Dataset {n!r} has no training samples; remove it from datasets=.")
        self.strategy, probs = resolve_strategy(config, self.sizes)
        self.probabilities = None if probs is None else dict(zip(self.names, probs))
        self._cdf = None if probs is None else torch.tensor(probs, dtype=torch.float64).cumsum(0)
        self.generator = torch.Generator().manual_seed((int(seed) + _SEED_SALT) % (2 ** 63))
        self.draws = 0

    def _draw(self) -> int:
        """Index of the next dataset; advances the generator the same way on every rank."""
        if self._cdf is None:
            return self.draws % len(self.names)
        u = torch.rand((), generator=self.generator, dtype=torch.float64)
        return min(int(torch.searchsorted(self._cdf, u, right=True)), len(self.names) - 1)

    def next_name(self) -> str:
        """Draw the dataset for the next batch (without fetching it)."""
        name = self.names[self._draw()]
        self.draws += 1
        return name

    def __next__(self) -> dict[str, Any]:
        name = self.next_name()
        batch = next(self.streams[name])
        if not isinstance(batch, dict):
            raise UserError(f"Dataset {name!r} collated a {type(batch).__name__}, not a dict; "
                            "its builder's collate() must return a dict of fields.")
        batch["dataset_name"] = name
        return batch

    def __iter__(self) -> "MultiStream":
        return self

    @property
    def batches_per_epoch(self) -> int:
        """One "epoch" = as many draws as all datasets' batches together."""
        return sum(int(s.batches_per_epoch) for s in self.streams.values())

    @property
    def epoch(self) -> int:
        """Completed epochs in draws: matches ``max_epochs`` x ``batches_per_epoch`` updates.

        (Not any one stream's epoch: under round robin or ratios a small
        dataset may be on its tenth pass while a large one is on its first.)
        """
        return self.draws // self.batches_per_epoch

    def state_dict(self) -> dict[str, Any]:
        return {"draws": self.draws, "generator": self.generator.get_state(),
                "streams": {n: s.state_dict() for n, s in self.streams.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore draws, the generator and each stream, so the run continues exactly."""
        if not isinstance(state, Mapping) or "streams" not in state:
            raise UserError("The checkpoint's data state is from a single-dataset run but this run "
                            f"trains on {', '.join(self.names)}; start without resuming, or resume "
                            "with the same datasets=.")
        saved = set(state["streams"])
        if saved != set(self.names):
            raise UserError(f"The checkpoint was trained on datasets {sorted(saved)} but this run "
                            f"uses {sorted(self.names)}; resume with the same datasets=.")
        for n, s in self.streams.items():
            s.load_state_dict(state["streams"][n])
        gen = state["generator"]
        self.generator.set_state(torch.as_tensor(gen).detach().to("cpu", torch.uint8).clone())
        self.draws = int(state["draws"])
