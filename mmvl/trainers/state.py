"""The contract between the loop and its callbacks, written down as types instead of a docstring.

:class:`TrainerState` is everything a callback may read about where the run is, and the two
things it may set (``should_stop``; ``preempted``). :class:`TrainerProtocol` is what a callback
may read and call on the Trainer it is built with. :data:`HOOKS` is the order of the events the
Trainer dispatches; every one goes to every callback in the callback list's order
(``training.builtin_callbacks``, then ``training.callbacks``). Every rank holds the same state.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol

from omegaconf import DictConfig

from mmvl.config import schema
from mmvl.distributed.env import DistEnv
from mmvl.engine import Engine
from mmvl.utils.flops import FlopCount

#: The hooks a callback may implement, in the order a training run first reaches them. The events
#: callbacks publish while a hook runs (:meth:`TrainerProtocol.publish`) reach every callback's
#: :data:`LOG_HOOK` right after that hook's round, in the order they were published; so a sink
#: never depends on where in the list the publisher sits.
HOOKS = ("on_train_start", "on_update_start", "on_update_end", "on_evaluation_end", "on_train_end")
LOG_HOOK = "on_log"


class Evaluation(NamedTuple):
    """One evaluation: at which update, of which split, with ``{dataset: {metric: value}}``."""

    update: int
    split: str
    results: dict[str, dict[str, float]]


@dataclasses.dataclass
class Best:
    """The best validation value of ``training.early_stop.criteria`` so far, and its update."""

    value: float | None = None
    update: int | None = None


@dataclasses.dataclass
class TrainerState:
    """Where the run is; the Trainer writes it, callbacks read it (and set ``should_stop``).

    ``best`` is kept by the evaluation (:class:`mmvl.trainers.evaluation.BestTracker`) before
    ``on_evaluation_end`` is dispatched, so whatever reads it (early stop, the checkpoint
    callback's ``best.ckpt``) sees this evaluation's verdict, whatever the callback order.
    """

    update: int = 0
    max_updates: int = 0
    epoch: int = 0
    should_stop: bool = False
    #: the signal name once the run stops for a preemption, else None
    preempted: str | None = None
    last_eval: Evaluation | None = None
    #: the update of the latest checkpoint (-1: none yet)
    last_saved: int = -1
    best: Best = dataclasses.field(default_factory=Best)

    @property
    def is_best(self) -> bool:
        """Whether a validation at this very update set a new best (then ``best.ckpt`` is written)."""
        last = self.last_eval
        return (self.best.update == self.update and last is not None and last.update == self.update
                and last.split == "val")


@dataclasses.dataclass(frozen=True)
class Sections:
    """The typed config sections callbacks read, built once from the loaded config (each callback
    reads its own part, e.g. ``sections.training.early_stop``, never ``config_value`` lookups)."""

    training: schema.Training
    checkpoint: schema.Checkpoint
    env: schema.Env
    #: the stages ``run_type`` names (train, val, test)
    stages: frozenset[str]

    @classmethod
    def of(cls, config: Any) -> "Sections":
        return cls(schema.section(config, "training"), schema.section(config, "checkpoint"),
                   schema.section(config, "env"), schema.stages(config))


class TrainerProtocol(Protocol):
    """What a callback may read and call on its Trainer (nothing else of it is a contract)."""

    state: TrainerState
    sections: Sections
    config: DictConfig  # the whole resolved config, for what records it (TensorBoard's hparams)
    env: DistEnv
    engine: Engine  # device, precision and the only door to collectives
    flops: FlopCount

    def save_checkpoint(self, is_best: bool = False, full: bool = False) -> None:
        """Checkpoint this update (every rank calls it)."""

    def evaluate(self, split: str = "val", during_training: bool = False) -> dict[str, dict[str, float]]:
        """Evaluate ``split`` (every rank calls it); dispatches ``on_evaluation_end``. ``during_training``:
        a periodic evaluation (``evaluation.generate_max_samples`` caps its generation metrics)."""

    def publish(self, event: dict[str, Any]) -> None:
        """Hand ``event`` to every callback's ``on_log`` once the running hook's round is over."""
