"""A run read back from its save dir: ``metrics.jsonl`` streams, ``config.yaml``, summaries.

What ``curves.png`` (the curves callback) and ``mmvl_plot`` draw and tabulate. A resumed
run appends to ``metrics.jsonl`` from its checkpoint's update, so events of an abandoned
segment (updates past the checkpoint it resumed from) are dropped: the newest segment wins.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from mmvl.config.schema import typed_section
from mmvl.errors import UserError, did_you_mean

#: event fields that are not metrics
BOOKKEEPING = frozenset({"update", "epoch", "split", "dataset", "wall_s"})
#: config keys that differ between any two runs without describing them
_UNLABELLED = ("env.save_dir", "env.data_dir")


def minimize(metric: str) -> bool:
    """Lower is better for losses, higher for everything else (the early-stop rule)."""
    return metric.endswith("loss")


def resolve_metric(name: str | None, results: Mapping[str, Mapping[str, Any]],
                   what: str = "metric", losses: Iterable[str] = ()) -> tuple[str, str]:
    """``<dataset>/<metric>`` (or a bare metric with one dataset) -> ``(dataset, metric)``;
    unknown names raise. None: the first dataset's first metric that is not a loss (a name
    in ``losses`` or ending in ``loss``) nor a sub-metric (``accuracy/relational``)."""
    if not results:
        raise UserError("there are no evaluation results to choose a metric from; run an evaluation first.")
    if not name:
        dataset, losses = next(iter(results)), set(losses)
        metric = next((k for k in results[dataset] if k not in BOOKKEEPING and k not in losses
                       and "/" not in k and not k.endswith("loss")), "total_loss")
        return dataset, metric
    dataset = next((d for d in results if str(name).startswith(d + "/")), None)
    metric = str(name)[len(dataset) + 1:] if dataset else str(name)
    dataset = dataset or next(iter(results))
    if metric not in results[dataset]:
        shown = [k for k in results[dataset] if k not in BOOKKEEPING]
        raise UserError(f"{what}={name!r} is not among the evaluation results of {dataset!r}."
                        f"{did_you_mean(metric, shown)} Available: {', '.join(shown)}.")
    return dataset, metric


def read_events(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every event of a ``metrics.jsonl``; an unfinished last line (a killed writer) is ignored."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{str(path)!r} does not exist; is {str(path.parent)!r} an mmvl save dir "
                        "(env.save_dir of a run)?")
    lines = path.read_text(encoding="utf-8").splitlines()
    events = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            if lineno == len(lines):
                break
            raise UserError(f"{str(path)!r} line {lineno} is not JSON; the file was edited or corrupted.") from None
    return events


def streams(events: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """``train``, ``val/<dataset>``, ``test/<dataset>`` -> events in update order, newest segment kept."""
    out: dict[str, list[dict[str, Any]]] = {}
    for event in events:
        name = event.get("split", "train") if "dataset" not in event else f"{event['split']}/{event['dataset']}"
        kept = out.setdefault(name, [])
        while kept and kept[-1]["update"] >= event["update"]:
            kept.pop()  # a resumed segment rewrites these updates
        kept.append(event)
    return out


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings -> ``{"a.b.c": leaf}`` (lists stay leaves)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class Run:
    """One save dir: its event streams and resolved config."""

    def __init__(self, save_dir: str | os.PathLike):
        self.save_dir = Path(save_dir)
        self.streams = streams(read_events(self.save_dir / "metrics.jsonl"))
        config_path = self.save_dir / "config.yaml"
        self.config: dict[str, Any] = {}
        if config_path.is_file():
            import yaml

            self.config = yaml.safe_load(config_path.read_text(encoding="utf-8")) or {}

    @property
    def train(self) -> list[dict[str, Any]]:
        return self.streams.get("train", [])

    def evaluations(self, split: str = "val") -> dict[str, list[dict[str, Any]]]:
        """``{dataset: events}`` of ``split``."""
        return {name.split("/", 1)[1]: ev for name, ev in self.streams.items() if name.startswith(split + "/")}

    def metrics(self, split: str = "val") -> dict[str, list[str]]:
        """``{dataset: metric names}`` in first-seen order."""
        out: dict[str, list[str]] = {}
        for dataset, events in self.evaluations(split).items():
            names = out.setdefault(dataset, [])
            for event in events:
                names.extend(k for k, v in event.items() if k not in BOOKKEEPING and k not in names
                             and isinstance(v, (int, float)))
        return out

    def loss_keys(self) -> list[str]:
        """Train fields that are losses: ``total_loss``, names ending in ``loss``, the configured
        losses, and any train field an evaluation also reports (evaluations report the losses)."""
        model = self.config.get("model")
        configured = (((self.config.get("model_config") or {}).get(model) or {}).get("losses") or []) if model else []
        named = {e if isinstance(e, str) else e.get("type") for e in configured}
        evaluated = {k for d in self.metrics("val").values() for k in d}
        keys: list[str] = []
        for event in self.train:
            keys.extend(k for k in event if k not in keys and k not in BOOKKEEPING
                        and (k.endswith("loss") or k in named or k in evaluated))
        return keys

    def series(self, stream: str, key: str) -> tuple[list[int], list[float]]:
        """(updates, values) of ``key`` in ``stream`` (``train`` or ``val/<dataset>``)."""
        points = [(e["update"], float(e[key])) for e in self.streams.get(stream, [])
                  if isinstance(e.get(key), (int, float))]
        return [u for u, _ in points], [v for _, v in points]

    def minimize(self, dataset: str, metric: str) -> bool:
        """The early-stop direction when this metric is its criterion, else :func:`minimize`."""
        stop = typed_section(self.config, "training").early_stop
        chosen = stop.minimize
        if chosen is not None and stop.criteria in (
                f"{dataset}/{metric}", metric):
            return bool(chosen)
        return minimize(metric) or metric in self.loss_keys()

    def title(self) -> str:
        """``<model> on <datasets>  (<save dir name>)``."""
        datasets = ", ".join(self.config.get("datasets") or [])
        what = f"{self.config.get('model')} on {datasets}" if self.config.get("model") else ""
        return f"{what}  ({self.save_dir.name})" if what else self.save_dir.name

    def default_metric(self) -> str | None:
        """``<dataset>/<metric>``: the early-stop criterion, else the first dataset's main metric."""
        last = {d: ev[-1] for d, ev in self.evaluations("val").items() if ev}
        if not last:
            return None
        criteria = typed_section(self.config, "training").early_stop.criteria
        dataset, metric = resolve_metric(criteria, last, "training.early_stop.criteria", self.loss_keys())
        return f"{dataset}/{metric}"

    @property
    def wall_s(self) -> float | None:
        times = [e["wall_s"] for s in self.streams.values() for e in s if "wall_s" in e]
        return max(times) if times else None

    def summary(self, split: str = "val") -> list[dict[str, Any]]:
        """Per metric: best value and its update (by :meth:`minimize`), last value and its update."""
        rows = []
        for dataset, names in self.metrics(split).items():
            for metric in names:
                updates, values = self.series(f"{split}/{dataset}", metric)
                pick = min if self.minimize(dataset, metric) else max
                best = pick(range(len(values)), key=lambda i: values[i])
                rows.append({"metric": f"{dataset}/{metric}", "best": values[best], "best_update": updates[best],
                             "last": values[-1], "last_update": updates[-1]})
        return rows


def differing_keys(configs: list[dict[str, Any]]) -> list[str]:
    """Dotted config keys whose values are not the same in every config (save dirs excluded)."""
    flat = [flatten(c) for c in configs]
    keys = sorted(set().union(*flat)) if flat else []
    missing = object()
    return [k for k in keys if k not in _UNLABELLED
            and len({json.dumps(f.get(k, missing), sort_keys=True, default=repr) for f in flat}) > 1]


def run_labels(runs: list[Run], max_keys: int = 3) -> list[str]:
    """``key=value, ...`` of the config keys that differ between the runs; the save dir's
    name when none differ (or to tell apart runs with equal labels)."""
    keys = differing_keys([r.config for r in runs])
    labels = []
    for run in runs:
        flat = flatten(run.config)
        parts = [f"{k}={_short(flat.get(k))}" for k in keys[:max_keys]]
        if len(keys) > max_keys:
            parts.append(f"+{len(keys) - max_keys} more")
        labels.append(", ".join(parts) or run.save_dir.name)
    if len(set(labels)) < len(labels):
        labels = [f"{label} ({run.save_dir.name})" for label, run in zip(labels, runs)]
    return labels


def _short(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, float):
        return f"{value:g}"
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def format_table(runs: list[Run], labels: list[str], split: str = "val") -> str:
    """One line per run and metric: best (at update), last (at update), and the run's wall time."""
    header = ("run", "metric", "best", "at update", "last", "at update", "wall time")
    rows = []
    for run, label in zip(runs, labels):
        wall = f"{run.wall_s:.1f} s" if run.wall_s is not None else "?"
        summary = run.summary(split) or [{"metric": f"(no {split} evaluation)", "best": None,
                                          "best_update": None, "last": None, "last_update": None}]
        for i, row in enumerate(summary):
            rows.append((label if i == 0 else "", row["metric"], _num(row["best"]), _num(row["best_update"]),
                         _num(row["last"]), _num(row["last_update"]), wall if i == 0 else ""))
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in [header, *rows]]
    return "\n".join(line.rstrip() for line in lines)


def _num(value: Any) -> str:
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.4f}"
