"""Callbacks: the named hooks the training loop calls, in list order.

Hooks (all optional; :data:`mmvl.trainers.state.HOOKS` is their order): ``on_train_start``,
``on_update_start``, ``on_update_end(info)``, ``on_evaluation_end(split, results)``,
``on_train_end``, and ``on_log(event)``. The Trainer dispatches every one of them itself;
``on_log`` receives every event a callback publishes (``trainer.publish``): the logging
callback's, which it also writes to ``metrics.jsonl`` (a train event every ``log_interval``
with losses, lr, throughput, MFU and memory; one event per evaluated dataset). It is the
place for other sinks (TensorBoard, trackers, a progress display). ``state_dict``/``load_state_dict`` put a
callback's state in the checkpoint under its registered name (``name[1]``, ``name[2]``
for the second and third of one name). The built-in callbacks are the registered names
listed in ``training.builtin_callbacks`` (configs/defaults.yaml), in the order the loop calls
them; ``wanted(config)`` lets one stay out of a run (TensorBoard without the package). Every rank calls every
hook with the same values; a callback that writes files checks
``trainer.engine.is_main_process``, and runs collectives through ``trainer.engine``. Callbacks
talk to each other only through :class:`mmvl.trainers.state.TrainerProtocol` (``trainer.state``:
``should_stop``, ``best``, ``is_best``, ...; ``save_checkpoint()``, ``publish()``), never by
looking each other up.
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager

from mmvl.trainers.state import TrainerProtocol


class Callback:
    def __init__(self, trainer: TrainerProtocol, **params: Any):
        self.trainer = trainer

    @classmethod
    def wanted(cls, sections: Any) -> bool:
        """Whether a run uses this callback at all (default: always); ``sections``: the typed sections
        callbacks read (:class:`mmvl.trainers.state.Sections`: ``sections.training``, ...)."""
        return True

    def on_train_start(self) -> None: ...

    def on_update_start(self) -> None: ...

    def on_update_end(self, info: dict[str, Any]) -> None: ...

    def on_evaluation_end(self, split: str, results: dict[str, dict[str, float]]) -> None: ...

    def on_log(self, event: dict[str, Any]) -> None: ...

    def on_train_end(self) -> None: ...

    def evaluating(self, split: str) -> ContextManager[None]:
        """Entered around every evaluation of ``split`` (all callbacks', in list order), e.g. to put
        other weights in the model for it (the ``ema`` callback)."""
        return contextlib.nullcontext()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
