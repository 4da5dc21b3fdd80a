"""MLflow: one experiment per project name, one run per ``init_trackers``, in a local file store.

The store is ``init_kwargs["tracking_uri"]``, else ``MLFLOW_TRACKING_URI``, else
``file:<logging_dir>/mlruns`` (the Trainer: ``<save_dir>/mlruns``): a run never needs a server.
MLflow 3 refuses a file store unless ``MLFLOW_ALLOW_FILE_STORE`` is true, so this tracker sets
that variable for the file store it chose. Open it with ``mlflow ui --backend-store-uri <uri>``.
Everything goes through one ``MlflowClient``, so no global active run is left behind.

A file store keeps each metric in a file named by its key, so ``val/toy/accuracy`` (a file) and
``val/toy/accuracy/even`` (a file inside it) cannot both exist: there, metric keys are written with
``.`` for ``/`` (:func:`metric_key`), as ``val.toy.accuracy`` and ``val.toy.accuracy.even``.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Mapping

from mmvl.registry import register_tracker
from mmvl.tracking.base import Tracker, Value, flat, numbers

log = logging.getLogger("mmvl")
#: MLflow's limits: parameters per ``log_batch`` call, characters of a parameter's value
BATCH, VALUE_CHARS = 100, 6000


def metric_key(key: str, uri: str) -> str:
    """``key`` as this store can hold it (``/`` -> ``.`` in a file store, see above)."""
    return key.replace("/", ".") if uri.startswith("file:") else key


@register_tracker("mlflow")
class MLflowTracker(Tracker):
    name = "mlflow"
    package = "mlflow"

    def __init__(self, project_name: str, logging_dir: str, **init_kwargs: Any):
        super().__init__(project_name, logging_dir, **init_kwargs)
        kwargs = dict(init_kwargs)
        uri = kwargs.pop("tracking_uri", None) or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = "file:" + os.path.abspath(os.path.join(logging_dir, "mlruns"))
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.uri, self.client = uri, MlflowClient(tracking_uri=uri)
        name = kwargs.pop("experiment_name", None) or project_name
        found = self.client.get_experiment_by_name(name)
        experiment = found.experiment_id if found is not None else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment, **kwargs).info.run_id
        log.info("MLflow run %s in %s (mlflow ui --backend-store-uri %s)", self.run_id, uri, uri)

    @property
    def tracker(self) -> Any:
        return self.client

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k[:250], str(v)[:VALUE_CHARS]) for k, v in flat(values).items()]
        for start in range(0, len(params), BATCH):
            self.client.log_batch(self.run_id, params=params[start:start + BATCH])

    def log(self, values: Mapping[str, Value], step: int | None = None) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        scalars = numbers(values)
        for key, value in values.items():  # a mapping of numbers: one metric per entry, key/entry
            if isinstance(value, Mapping):
                scalars.update({f"{key}/{k}": v for k, v in numbers(value).items()})
        metrics = [Metric(metric_key(k, self.uri), v, now, int(step or 0)) for k, v in scalars.items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, final: Mapping[str, float] | None = None) -> None:
        self.client.set_terminated(self.run_id)
