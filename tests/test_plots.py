"""The pictures: panels of curves.png, smoothing, the comparison figure, atomic PNG writes."""
from __future__ import annotations

import pytest
from PIL import Image

from mmvl.plots import draw_comparison, draw_run, run_panels, smooth
from mmvl.runs import Run
from tests.test_runs import CONFIG, _train, _val, write_run


def test_smooth_is_a_debiased_moving_average():
    assert smooth([2.0, 2.0, 2.0], weight=0.6) == pytest.approx([2.0, 2.0, 2.0])
    out = smooth([0.0, 10.0], weight=0.5)
    assert out[0] == 0.0 and out[1] == pytest.approx(10.0 * 0.5 / 0.75)
    assert smooth([1.0, 5.0, 2.0]) == [1.0, 5.0, 2.0]  # short curves are drawn as they are
    long = smooth([float(i % 2) for i in range(400)])  # 5% span: the zig-zag flattens to ~0.5
    assert max(long[100:]) - min(long[100:]) < 0.1


def test_panels_group_losses_lr_and_metric_families(tmp_path):
    events = [_train(2, 1.0), _val(2, 0.5, 0.9, **{"accuracy/x": 0.4}), _train(4, 0.8), _val(4, 0.7, 0.7)]
    run = Run(write_run(tmp_path / "r", events, CONFIG))
    assert run_panels(run) == [  # one loss: total_loss is the same curve, drawn once
        ("train loss", [("train", "cross_entropy")]),
        ("learning rate", [("train", "lr")]),
        ("val toy: loss", [("val/toy", "cross_entropy")]),
        ("val toy: accuracy", [("val/toy", "accuracy"), ("val/toy", "accuracy/x")]),
    ]
    two = [{**e, "mlm": 0.5} for e in events]
    run = Run(write_run(tmp_path / "two", two, CONFIG))
    assert run_panels(run)[0] == ("train loss", [("train", "cross_entropy"), ("train", "total_loss"),
                                                 ("train", "mlm")])
    assert run_panels(run)[2] == ("val toy: loss", [("val/toy", "cross_entropy"), ("val/toy", "total_loss"),
                                                    ("val/toy", "mlm")])


def test_draw_run_writes_a_png_atomically(tmp_path):
    events = [e for u in range(1, 30) for e in ([_train(u, 1.0 / u)] + ([_val(u, u / 30, 1.0 / u)] if u % 5 == 0 else []))]
    run = Run(write_run(tmp_path / "r", events, CONFIG))
    path = draw_run(run, tmp_path / "r" / "curves.png")
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == (672, 520)  # 2x2 panels at 80 dpi
    assert not list((tmp_path / "r").glob(".curves.png.*"))  # no temp file left behind


def test_comparison_draws_the_chosen_metric(tmp_path):
    a = Run(write_run(tmp_path / "a", [_train(2, 1.0), _val(2, 0.5, 0.9)], CONFIG))
    b = Run(write_run(tmp_path / "b", [_train(2, 0.9), _val(2, 0.6, 0.8)], CONFIG))
    path, metric = draw_comparison([a, b], ["a", "b"], None, tmp_path / "c.png")
    assert metric == "toy/accuracy" and path.stat().st_size > 5000
    _, metric = draw_comparison([a, b], ["a", "b"], "toy/total_loss", tmp_path / "c.png")
    assert metric == "toy/total_loss"


def test_priors_are_dashed_in_their_metrics_colour_without_a_legend_entry(tmp_path, monkeypatch):
    import mmvl.plots as plots

    extra = {"accuracy/x": 0.4, "accuracy/prior": 0.3, "accuracy/prior/x": 0.2}
    events = [_train(2, 1.0), _val(2, 0.5, 0.9, **extra), _train(4, 0.8), _val(4, 0.7, 0.7, **extra)]
    run = Run(write_run(tmp_path / "r", events, CONFIG))
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig))
    draw_run(run, tmp_path / "r" / "curves.png")
    ax = next(a for a in figures[0].axes if a.get_title() == "val toy: accuracy")
    solid = {line.get_label(): line for line in ax.get_lines() if line.get_linestyle() == "-"}
    dashed = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert len(dashed) == 2 and all(line.get_label() == "_nolegend_" for line in dashed)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["accuracy", "accuracy/x"]
    colors = sorted(str(line.get_color()) for line in dashed)
    assert colors == sorted(str(solid[k].get_color()) for k in ("accuracy", "accuracy/x"))
