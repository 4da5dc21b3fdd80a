"""Pictures of runs with matplotlib's Agg backend: ``curves.png`` of one run, ``mmvl_plot``'s comparison.

Figures are built on ``matplotlib.figure.Figure`` with an Agg canvas (no pyplot, no GUI,
no global state) and written with the project's atomic writer, so a reader never sees a
half-written PNG. Train curves are drawn raw (faint) and smoothed (an exponential moving
average, debiased like TensorBoard's); each validation metric marks its best point.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from mmvl.io import atomic_write
from mmvl.runs import Run, resolve_metric

_DPI = 80


def smooth(values: list[float], weight: float | None = None) -> list[float]:
    """Debiased exponential moving average (the first points are not pulled towards 0).

    ``weight`` None: spans about 5% of the points (none below 20 points), so a short
    curve is not dragged behind its raw values and a long one is still readable.
    """
    if weight is None:
        weight = max(0.0, 1.0 - 20.0 / len(values)) if values else 0.0
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight ** i))
    return out


def _figure(panels: int, title: str) -> tuple[Any, list[Any]]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cols = max(1, panels if panels <= 3 else min(3, math.ceil(math.sqrt(panels))))
    rows = (max(panels, 1) + cols - 1) // cols
    height = 3.0 * rows + 0.5
    fig = Figure(figsize=(4.2 * cols, height), dpi=_DPI)
    FigureCanvasAgg(fig)
    # fixed margins: a layout engine would cost as much as drawing the figure again
    fig.subplots_adjust(left=0.07 if cols > 1 else 0.14, right=0.98, bottom=0.5 / height,
                        top=1 - 0.55 / height, wspace=0.28, hspace=0.55)
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(max(panels, 1))]
    fig.suptitle(title, fontsize=10)
    return fig, axes


def _style(ax: Any, title: str, log_y: bool = False) -> None:
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("update", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    if log_y:
        ax.set_yscale("log")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _train_curve(ax: Any, updates: list[int], values: list[float], label: str, color: Any) -> None:
    ax.plot(updates, values, color=color, alpha=0.25, linewidth=1)
    ax.plot(updates, smooth(values), color=color, linewidth=1.6, label=label)


def _metric_curve(ax: Any, updates: list[int], values: list[float], label: str, color: Any,
                  minimize: bool) -> None:
    ax.plot(updates, values, color=color, marker="o", markersize=3, linewidth=1.4, label=label)
    if len(values) > 1 and max(values) > min(values):
        best = (min if minimize else max)(range(len(values)), key=lambda i: values[i])
        ax.plot([updates[best]], [values[best]], marker="*", markersize=12, color=color,
                markeredgecolor="black", markeredgewidth=0.6, linestyle="none")
        right = best >= len(values) / 2  # keep the label inside the axes
        ax.annotate(f"{values[best]:.4g}", (updates[best], values[best]), textcoords="offset points",
                    xytext=(-6 if right else 6, 6), ha="right" if right else "left", fontsize=7)


def _save(fig: Any, path: str | os.PathLike) -> Path:
    return atomic_write(Path(path), "wb", lambda f: fig.savefig(f, format="png", dpi=_DPI))


def run_panels(run: Run) -> list[tuple[str, list[tuple[str, str]]]]:
    """The panels of ``curves.png``: (title, [(stream, key), ...])."""
    panels = []
    losses = _drop_lone_total(run.loss_keys())
    if losses:
        panels.append(("train loss", [("train", k) for k in losses]))
    if any("lr" in e for e in run.train):
        panels.append(("learning rate", [("train", "lr")]))
    for dataset, names in run.metrics("val").items():
        groups: dict[str, list[tuple[str, str]]] = {}
        for name in names:  # one panel for the losses, one per metric family (accuracy, accuracy/x, ...)
            group = "loss" if name.endswith("loss") or name in run.loss_keys() else name.split("/", 1)[0]
            groups.setdefault(group, []).append((f"val/{dataset}", name))
        if "loss" in groups:
            kept = _drop_lone_total([k for _, k in groups["loss"]])
            groups["loss"] = [(f"val/{dataset}", k) for k in kept]
        panels.extend((f"val {dataset}: {group}", keys) for group, keys in groups.items())
    return panels


def is_prior(metric: str) -> bool:
    """``accuracy/prior``, ``accuracy/prior/<group>``: a reference a dataset reports (what a model
    blind to the input scores), drawn dashed beside the metric it belongs to."""
    return "/prior" in metric


def _drop_lone_total(losses: list[str]) -> list[str]:
    """With a single loss, ``total_loss`` is the same curve: draw it once."""
    parts = [k for k in losses if k != "total_loss"]
    return parts if len(parts) == 1 and "total_loss" in losses else losses


def draw_run(run: Run, path: str | os.PathLike) -> Path:
    """``curves.png``: train losses (raw faint, smoothed), lr, each validation metric with its best point."""
    panels = run_panels(run)
    fig, axes = _figure(len(panels), run.title())
    colors = _colors()
    for ax, (title, keys) in zip(axes, panels):
        measured = [k for k in keys if not is_prior(k[1])]
        for stream, key in keys:
            updates, values = run.series(stream, key)
            if not values:
                continue
            if is_prior(key):  # dashed in its metric's colour, no legend entry: the line to beat
                twin = (stream, key.replace("/prior", "", 1))
                i = measured.index(twin) if twin in measured else len(measured)
                ax.plot(updates, values, color=colors[i % len(colors)], linestyle="--", linewidth=0.9,
                        alpha=0.8, label="_nolegend_")
                continue
            color = colors[measured.index((stream, key)) % len(colors)]
            if stream == "train" and key != "lr":
                _train_curve(ax, updates, values, key, color)
            elif stream == "train":
                ax.plot(updates, values, color=color, linewidth=1.4)
            else:
                dataset = stream.split("/", 1)[1]
                _metric_curve(ax, updates, values, key, color, run.minimize(dataset, key))
        _style(ax, title)
    if not panels:
        axes[0].text(0.5, 0.5, "no events yet", ha="center", va="center")
    return _save(fig, path)


def draw_comparison(runs: list[Run], labels: list[str], metric: str | None,
                    path: str | os.PathLike) -> tuple[Path, str | None]:
    """One figure: every run's smoothed train ``total_loss`` and its ``metric`` curve (labelled
    by ``labels``). Returns the path and the ``<dataset>/<metric>`` drawn (None: no evaluations)."""
    chosen = metric or next((r.default_metric() for r in runs if r.default_metric()), None)
    fig, axes = _figure(2 if chosen else 1, "  vs  ".join(labels) if len(labels) <= 3 else f"{len(labels)} runs")
    colors = _colors()
    for i, (run, label) in enumerate(zip(runs, labels)):
        color = colors[i % len(colors)]
        updates, values = run.series("train", "total_loss")
        if values:
            _train_curve(axes[0], updates, values, label, color)
        if chosen:
            last = {d: ev[-1] for d, ev in run.evaluations("val").items() if ev}
            if not last:
                continue
            dataset, name = resolve_metric(chosen, last, "--metric")
            updates, values = run.series(f"val/{dataset}", name)
            _metric_curve(axes[1], updates, values, label, color, run.minimize(dataset, name))
    _style(axes[0], "train total_loss (smoothed)")
    if chosen:
        _style(axes[1], f"val {chosen}")
    return _save(fig, path), chosen


def _colors() -> list[Any]:
    from matplotlib import rcParams

    return list(rcParams["axes.prop_cycle"].by_key()["color"])
