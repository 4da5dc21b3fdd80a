"""A question-conditioned pixel encoder (FiLM, Perez et al. 2018) for VisualBERT.

Why: in Sort-of-CLEVR-style questions ("is the red object on the left?") the
hard part is binding a word to the right object. Late fusion in a transformer
has to discover that binding through attention from scratch, which stayed at
chance for thousands of updates in our runs. Modulating a per-pixel (1x1)
colour/texture layer by the question, before the conv stack, lets the word
select which pixels survive; the rest of the encoder then solves a
single-object problem, learnt in a few hundred updates.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mmvl.errors import UserError
from mmvl.models.modules.image_encoders import CNNEncoder, add_coords
from mmvl.registry import register_image_encoder


@register_image_encoder("film_cnn")
class FiLMCNNEncoder(CNNEncoder):
    """``CNNEncoder`` whose channels are scaled/shifted by a condition vector (the question).

    ``pixel_layer``: FiLM a 1x1 conv on the pixels before the conv stack.
    ``every_layer``: FiLM each conv layer after its GroupNorm, before the ReLU (FiLM's own
    design); the word can then select an object's colour early and gate its shape features
    later. On Sort-of-CLEVR this solved all non-relational questions (shape included) in
    2,000 updates, where the pixel layer alone left shape at chance after 4,000.
    ``film_layers``: FiLM only these conv layers (0-based), e.g. ``[2]`` for the last of three.
    Why: FiLM on the first layer lets the question gate colours before shapes are seen, so
    the visual tokens keep only the named object's shape (a linear probe reads the other
    objects' shapes at chance, ``benchmarks/sort_of_clevr_probe.py``), and no question
    about *another* object's shape (closest, furthest, count) can be answered. FiLM on the
    last layer only highlights the named object while every object's shape survives.
    ``unconditioned_view``: also run the same conv layers without FiLM and concatenate both
    outputs per cell (``out_dim`` doubles, the cost too). The FiLM view marks the object the
    question names; the plain view keeps every object's shape and position, computed by the
    very filters the questions trained, so early FiLM's fast binding and a full scene coexist.
    ``forward(images, cond)`` with ``cond`` of shape ``(B, cond_dim)``; without
    ``cond`` the modulation is the identity.
    """

    conditioned = True

    def __init__(self, cond_dim: int, film_channels: int = 24, in_channels: int = 3,
                 pixel_layer: bool = True, every_layer: bool = False, film_layers: list[int] | None = None,
                 unconditioned_view: bool = False, **kwargs):
        if every_layer and film_layers is not None:
            raise UserError("film_cnn: every_layer and film_layers are both set; every_layer FiLMs all conv layers, "
                            "film_layers only the listed ones: give one of them.")
        if not (pixel_layer or every_layer or film_layers):
            raise UserError("film_cnn: pixel_layer, every_layer and film_layers are all off; enable at least one.")
        if unconditioned_view and pixel_layer:
            raise UserError("film_cnn: unconditioned_view needs pixel_layer: false (the pixel FiLM layer would "
                            "condition both views); FiLM the conv layers with every_layer or film_layers.")
        super().__init__(in_channels=film_channels if pixel_layer else in_channels, **kwargs)
        self.unconditioned_view = bool(unconditioned_view)
        self.out_dim = self.out_dim * (2 if unconditioned_view else 1)
        # normalised first: word embeddings start tiny (std 0.02), which would stall FiLM's gradient
        self.cond_norm = nn.LayerNorm(cond_dim, elementwise_affine=False)
        self.pixel = nn.Conv2d(in_channels, film_channels, 1) if pixel_layer else None
        self.film = nn.Linear(cond_dim, 2 * film_channels) if pixel_layer else None
        layers = list(range(len(self.stages))) if every_layer else [int(i) for i in film_layers or []]
        bad = [i for i in layers if not 0 <= i < len(self.stages)]
        if bad:
            raise UserError(f"film_cnn: film_layers {bad} out of range; the encoder has conv layers "
                            f"0..{len(self.stages) - 1}.")
        self.layer_films = nn.ModuleDict({str(i): nn.Linear(cond_dim, 2 * self.stages[i][0].out_channels)
                                          for i in layers}) if layers else None
        for film in (self.layer_films or {}).values():  # start as the identity modulation
            nn.init.normal_(film.weight, std=0.02)
            nn.init.zeros_(film.bias)

    def forward(self, images: torch.Tensor, cond: torch.Tensor | None = None) -> torch.Tensor:
        c = None if cond is None else self.cond_norm(cond.to(images.dtype))
        x = images
        if self.pixel is not None:
            x = self.pixel(x)
            if c is not None:
                gamma, beta = self.film(c).chunk(2, dim=-1)
                x = x * (1 + gamma[:, :, None, None]) + beta[:, :, None, None]
            x = torch.relu(x)
        x = add_coords(x) if self.coords else x
        if self.layer_films is None or c is None:
            plain = self.run_stages(x)
            return torch.cat([plain, plain], dim=1) if self.unconditioned_view else plain
        first = min(int(i) for i in self.layer_films)  # the layers before it are shared by both views
        x = self._stages(x, 0, first, None)
        conditioned = self._stages(x, first, len(self.stages), c)
        if not self.unconditioned_view:
            return conditioned
        return torch.cat([self._stages(x, first, len(self.stages), None), conditioned], dim=1)

    def _stages(self, x: torch.Tensor, start: int, stop: int, c: torch.Tensor | None) -> torch.Tensor:
        """Conv layers ``start..stop-1``, FiLM-ed where configured when ``c`` is given."""
        ckpt = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for i in range(start, stop):
            stage = self.stages[i]
            film = self.layer_films[str(i)] if c is not None and str(i) in self.layer_films else None
            if film is None:
                x = checkpoint(stage, x, use_reentrant=False) if ckpt else stage(x)
            else:
                x = checkpoint(_film_stage, stage, film, x, c, use_reentrant=False) if ckpt else _film_stage(stage, film, x, c)
        return x


def _film_stage(stage: nn.Sequential, film: nn.Linear, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
    """conv -> GroupNorm -> FiLM(cond) -> ReLU."""
    conv, norm, act = stage
    gamma, beta = film(cond).chunk(2, dim=-1)
    return act(norm(conv(x)) * (1 + gamma[:, :, None, None]) + beta[:, :, None, None])

