"""Linear probes: what a trained model's visual tokens know about each object in a scene.

Why: a model that answers relational questions at the prior either never
represented the objects' positions and shapes, or represented them and failed to
compare them. A linear read-out (ridge regression, closed form) from the visual
tokens to every object's (x, y) and shape tells the two apart, and its split
into the object the question names ("queried") and the others shows whether a
question-conditioned encoder keeps the rest of the scene.

The arithmetic (:func:`ridge_fit`, :func:`r2_score`, :func:`probe_objects`) works
on plain tensors; :func:`collect_outputs` reads any sub-module's output through
a forward hook, so every registered model can be probed the same way
(``benchmarks/sort_of_clevr_probe.py`` does it from a run's checkpoint).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from mmvl.errors import UserError


def ridge_fit(x: torch.Tensor, y: torch.Tensor, l2: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight F x T, bias T)`` minimising ``|x W + b - y|^2 + l2 * N * |W|^2`` (float64, closed form).

    ``x`` is N x F, ``y`` N x T. The bias is not penalised (data are centred first).
    """
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise UserError(f"ridge_fit: need x N x F and y N x T, got {tuple(x.shape)} and {tuple(y.shape)}.")
    x, y = x.double(), y.double()
    x_mean, y_mean = x.mean(0), y.mean(0)
    xc, yc = x - x_mean, y - y_mean
    gram = xc.T @ xc + l2 * x.shape[0] * torch.eye(x.shape[1], dtype=x.dtype)
    weight = torch.linalg.solve(gram, xc.T @ yc)
    return weight, y_mean - x_mean @ weight


def ridge_predict(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return x.double() @ weight + bias


def r2_score(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-column coefficient of determination, ``1 - SS_res / SS_tot`` (1: exact; 0: the mean's error)."""
    target = target.double()
    ss_res = ((pred.double() - target) ** 2).sum(0)
    ss_tot = ((target - target.mean(0)) ** 2).sum(0)
    return 1.0 - ss_res / ss_tot.clamp(min=1e-12)


def scene_targets(centers: torch.Tensor, shapes: torch.Tensor, size: float) -> torch.Tensor:
    """N x 6 x 2 centres (pixels) and N x 6 shapes (0/1) -> N x 18 targets: x, y in [0, 1] and shape as -1/+1."""
    n, k = shapes.shape
    pos = centers.double().reshape(n, k * 2) / float(size)
    return torch.cat([pos, shapes.double() * 2 - 1], dim=1)


def choose_l2(x: torch.Tensor, y: torch.Tensor, candidates: float | Sequence[float]) -> float:
    """The penalty with the smallest squared error on the last fifth of ``x``, fitted on the rest.

    Thousands of token features against a few thousand samples overfit without a penalty,
    and the right one depends on the features' scale; the test samples never choose it.
    """
    if isinstance(candidates, (int, float)):
        return float(candidates)
    cut = x.shape[0] * 4 // 5
    errors = {float(l2): ((ridge_predict(x[cut:], *ridge_fit(x[:cut], y[:cut], float(l2))) - y[cut:].double()) ** 2
                          ).sum().item() for l2 in candidates}
    return min(errors, key=errors.get)


def probe_objects(train_x: torch.Tensor, train_scene: Mapping[str, torch.Tensor], test_x: torch.Tensor,
                  test_scene: Mapping[str, torch.Tensor], size: float,
                  l2: float | Sequence[float] = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)) -> dict[str, float]:
    """Fit a linear read-out of every object's position and shape on ``train_*``, score it on ``test_*``.

    A scene is ``{"centers": N x K x 2, "shapes": N x K, "queried": N}`` (``queried``: the index
    of the object the sample's question names). Returns ``position/r2`` (mean over the 2K
    coordinates), ``position/rmse_px`` and ``shape/accuracy`` (sign of the read-out), each also
    for the queried object and for the others (``.../queried``, ``.../others``), and the ridge
    penalty used (``l2``: a list of candidates is chosen from with :func:`choose_l2`).
    """
    k = train_scene["shapes"].shape[1]
    train_y = scene_targets(train_scene["centers"], train_scene["shapes"], size)
    l2 = choose_l2(train_x, train_y, l2)
    weight, bias = ridge_fit(train_x, train_y, l2)
    pred = ridge_predict(test_x, weight, bias)
    target = scene_targets(test_scene["centers"], test_scene["shapes"], size)
    n = target.shape[0]
    pos_err = ((pred[:, : 2 * k] - target[:, : 2 * k]) * size).reshape(n, k, 2)
    pos_r2 = r2_score(pred[:, : 2 * k], target[:, : 2 * k]).reshape(k, 2)
    shape_hit = ((pred[:, 2 * k:] > 0) == (target[:, 2 * k:] > 0)).double()  # N x K
    queried = torch.nn.functional.one_hot(test_scene["queried"].long(), k).bool()
    out = {"position/r2": pos_r2.mean().item(),
           "position/rmse_px": pos_err.pow(2).sum(-1).mean().sqrt().item(),
           "shape/accuracy": shape_hit.mean().item(), "l2": l2}
    for name, sel in (("queried", queried), ("others", ~queried)):
        out[f"position/rmse_px/{name}"] = pos_err.pow(2).sum(-1)[sel].mean().sqrt().item()
        out[f"shape/accuracy/{name}"] = shape_hit[sel].mean().item()
    return out


@torch.no_grad()
def collect_outputs(model: nn.Module, batches: Iterable[dict[str, Any]], module_name: str,
                    last_tokens: int | None = None) -> torch.Tensor:
    """Run ``model`` on ``batches`` and return ``module_name``'s output, one flattened row per sample.

    ``last_tokens``: keep only the last N positions of a B x L x D output (e.g. the visual
    tokens after the text in a single-stream transformer, whose text length varies).
    """
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        names = [n for n, _ in model.named_modules() if n][:12]
        raise UserError(f"probe: the model has no sub-module {module_name!r}; some of its modules: "
                        f"{', '.join(names)}.") from None
    rows: list[torch.Tensor] = []

    def keep(_module: nn.Module, _inputs: Any, output: Any) -> None:
        out = output[0] if isinstance(output, (tuple, list)) else getattr(output, "last_hidden_state", output)
        if last_tokens:
            out = out[:, -int(last_tokens):]
        rows.append(out.detach().float().flatten(1).cpu())

    handle = module.register_forward_hook(keep)
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            model(batch)
    finally:
        handle.remove()
        model.train(was_training)
    if not rows:
        raise UserError(f"probe: no output was collected from {module_name!r}; are the batches empty?")
    return torch.cat(rows)
