"""The Relation Network's parts: all-pairs relations, their geometry, and a per-object encoder.

:class:`PairwiseRelation` is ``sum_{i,j} g([o_i; o_j; q])`` with g's first layer split into
per-object and per-question products; :func:`pair_geometry` is what a pair's positions add to it;
:class:`ObjectEncoder` is the optional MLP (FiLM-ed by the question) applied to every object first.
The model that assembles them is :mod:`mmvl.models.relation_network`.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mmvl.errors import UserError
from mmvl.models.modules.visual_tokens import BOX_DIM

#: width of :func:`pair_geometry`: x_i, y_i, x_j, y_j, x_i - x_j, y_i - y_j and the distance
GEOMETRY_DIM = 7


def pair_geometry(positions: torch.Tensor) -> torch.Tensor:
    """``B x N x 2`` positions in [-1, 1] -> ``B x N x N x 7``: both positions, offset and distance.

    Relation models over detector regions feed g the pair's relative geometry (as in Hu et al.,
    2018, "Relation Networks for Object Detection"): "which object is closest" is then a
    comparison of one input across pairs, not a distance g must first learn to compute from
    two coordinates it sees only after an object encoder has mixed them with appearance.
    """
    return geometry_between(positions, positions)


def geometry_between(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """``B x N x 2`` and ``B x M x 2`` -> ``B x N x M x 7``: every (first, second) pair's geometry."""
    n, m = first.shape[1], second.shape[1]
    a = first.unsqueeze(2).expand(-1, -1, m, -1)
    b = second.unsqueeze(1).expand(-1, n, -1, -1)
    offset = a - b
    distance = offset.pow(2).sum(-1, keepdim=True).clamp(min=1e-12).sqrt()
    return torch.cat([a, b, offset, distance], dim=-1)


def object_positions(objects: torch.Tensor, regions: bool) -> torch.Tensor:
    """Each raw object's centre in [-1, 1]: from its box features (x1, y1, x2, y2, area, the last
    five columns) for regions, or its appended cell coordinates (the last two) for a feature map."""
    if regions:
        box = objects[..., -BOX_DIM:]
        return torch.stack([box[..., 0] + box[..., 2], box[..., 1] + box[..., 3]], dim=-1) - 1.0
    return objects[..., -2:]


def cell_coordinates(h: int, w: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``(h*w, 2)``: each cell's (x, y) in [-1, 1], row-major (the order of ``grid.flatten(2)``)."""
    ys = torch.linspace(-1.0, 1.0, h, device=device, dtype=dtype)
    xs = torch.linspace(-1.0, 1.0, w, device=device, dtype=dtype)
    return torch.stack([xs.repeat(h), ys.repeat_interleave(w)], dim=-1)


class PairwiseRelation(nn.Module):
    """``sum_{i,j} g([o_i; o_j; q])`` over all ordered pairs (i = j included, as in the paper).

    ``reduction: mean`` divides the sum by the number of pairs: the same function, but f's
    input no longer grows with the map's size (625 pairs summed start f far from its init scale).

    ``g``'s first layer is split into its three blocks (object i, object j, question) and
    summed by broadcasting, which equals one linear layer on the concatenated pair.
    """

    def __init__(self, object_dim: int, question_dim: int, hidden_sizes: list[int], reduction: str = "sum",
                 geometry: bool = False, pooled_first: bool = False):
        super().__init__()
        if not hidden_sizes:
            raise UserError("relation_network: g_hidden_sizes is empty; give at least one layer width.")
        if reduction not in ("sum", "mean"):
            raise UserError(f"relation_network: pair_reduction={reduction!r}; use 'sum' (the paper) or 'mean'.")
        self.reduction = reduction
        first = hidden_sizes[0]
        self.left = nn.Linear(object_dim, first, bias=False)
        self.right = nn.Linear(object_dim, first, bias=False)
        self.question = nn.Linear(question_dim, first)
        self.geometry = nn.Linear(GEOMETRY_DIM, first, bias=False) if geometry else None
        layers: list[nn.Module] = []
        for prev, width in zip(hidden_sizes, hidden_sizes[1:]):
            layers += [nn.Linear(prev, width), nn.ReLU(inplace=True)]
        self.rest = nn.Sequential(*layers)
        self.out_dim = hidden_sizes[-1]
        self.checkpointing = False
        self.pooled_first = pooled_first

    def forward(self, objects: torch.Tensor, question: torch.Tensor, mask: torch.Tensor | None = None,
                first: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``objects`` B x N x D, ``question`` B x Q, ``mask`` B x N (0: padding) -> B x out_dim.

        ``first`` (B x N, summing to 1 over the real objects) weighs each pair (i, j) by object
        i's weight, replacing the reduction: ``sum_i first_i sum_j g(o_i, o_j, q)``.
        ``positions`` (B x N x 2, required with ``geometry``) add :func:`pair_geometry` to g's input.
        """
        if (positions is None) != (self.geometry is None):
            raise ValueError("PairwiseRelation: pass positions exactly when built with geometry=True")
        if self.checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(self._relate, objects, question, mask, first, positions, use_reentrant=False)
        return self._relate(objects, question, mask, first, positions)

    def _relate(self, objects: torch.Tensor, question: torch.Tensor, mask: torch.Tensor | None,
                first: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        if self.pooled_first and first is not None:
            return self._relate_pooled(objects, question, mask, first, positions)
        pairs = (self.left(objects).unsqueeze(2) + self.right(objects).unsqueeze(1)
                 + self.question(question)[:, None, None, :])  # B x N x N x H
        if self.geometry is not None:
            pairs = pairs + self.geometry(pair_geometry(positions.to(pairs.dtype)))
        out = self.rest(torch.relu(pairs))
        if mask is None and first is None:
            return out.sum(dim=(1, 2)) if self.reduction == "sum" else out.mean(dim=(1, 2))
        m = torch.ones(out.shape[:2], dtype=out.dtype, device=out.device) if mask is None else mask.to(out.dtype)
        if first is not None:  # object i's weight times whether j is real
            return (out * (first.to(out.dtype).unsqueeze(2) * m.unsqueeze(1)).unsqueeze(-1)).sum(dim=(1, 2))
        weights = (m.unsqueeze(2) * m.unsqueeze(1)).unsqueeze(-1)  # a pair counts if both objects are real
        total = (out * weights).sum(dim=(1, 2))
        return total if self.reduction == "sum" else total / weights.sum(dim=(1, 2)).clamp(min=1)

    def _relate_pooled(self, objects: torch.Tensor, question: torch.Tensor, mask: torch.Tensor | None,
                       first: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """``sum_j g(sum_i first_i o_i, o_j, q)``: the attended object is every pair's first.

        g's first layer is linear, so its object-i block of the pooled object equals the attention-
        weighted sum of the per-pair blocks; with a one-hot attention the whole sum equals
        :meth:`_relate`'s. N pairs per question instead of N^2. The geometry is the pooled
        position's (the attention-weighted mean) against each object's.
        """
        weights = first.to(objects.dtype)
        pooled = (weights.unsqueeze(-1) * objects).sum(1)  # B x D
        rows = (self.left(pooled).unsqueeze(1) + self.right(objects)
                + self.question(question).unsqueeze(1))  # B x N x H
        if self.geometry is not None:
            pos = positions.to(rows.dtype)
            centre = (weights.unsqueeze(-1) * pos).sum(1, keepdim=True)  # B x 1 x 2
            rows = rows + self.geometry(geometry_between(centre, pos).squeeze(1))
        out = self.rest(torch.relu(rows))
        if mask is not None:
            out = out * mask.to(out.dtype).unsqueeze(-1)
        return out.sum(1)


class ObjectEncoder(nn.Module):
    """An MLP applied to every object before the pairs (no layers: the identity, as in the paper).

    With ``cond_dim`` each layer is FiLM-ed by the question (what ``RelationNetwork.condition``
    returns), ``relu((W o + b) * (1 + gamma(q)) + beta(q))`` (gamma, beta start at 0): a
    product of question and object features, so "is this
    the object the question names" is one layer away instead of a three-way interaction that g has
    to discover through ReLU thresholds.
    """

    def __init__(self, in_dim: int, sizes: list[int], cond_dim: int | None):
        super().__init__()
        self.layers = nn.ModuleList()
        self.films = nn.ModuleList()
        for width in sizes:
            self.layers.append(nn.Linear(in_dim, width))
            if cond_dim:
                film = nn.Linear(cond_dim, 2 * width)
                nn.init.zeros_(film.weight)
                nn.init.zeros_(film.bias)
                self.films.append(film)
            in_dim = width
        self.out_dim = in_dim

    def forward(self, objects: torch.Tensor, question: torch.Tensor | None) -> torch.Tensor:
        """``question`` None: the layers without their FiLM (the objects as the question does not see them)."""
        h = objects
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if len(self.films) and question is not None:
                gamma, beta = self.films[i](question.to(h.dtype)).unsqueeze(1).chunk(2, dim=-1)
                h = h * (1 + gamma) + beta
            h = torch.relu(h)
        return h
