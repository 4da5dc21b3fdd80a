"""``torchvision_transforms``: an image pipeline written as a YAML list.

::

    image_processor:
      type: torchvision_transforms
      params:
        transforms:
          - {type: Resize, params: {size: [224, 224]}}
          - ToImage
          - {type: ToDtype, params: {dtype: float32, scale: true}}
          - {type: Normalize, params: {mean: [0.485, 0.456, 0.406], std: [0.229, 0.224, 0.225]}}

Names resolve in ``torchvision.transforms.v2`` (``torchvision.transforms`` on
old torchvision); ``dtype`` and ``interpolation`` values are given by name, and
transforms taking other transforms (``RandomApply``, ``RandomChoice``,
``Compose``) take nested lists of the same form. The result is always a float
``C x H x W`` tensor: a PIL or uint8 result is scaled to ``[0, 1]``.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from mmvl.config.components import component_spec
from mmvl.errors import UserError, did_you_mean
from mmvl.registry import register_processor

#: transforms that cannot be written as data
_EXCLUDED = {"Lambda", "Transform", "InterpolationMode", "AutoAugmentPolicy"}


def _namespace() -> Any:
    try:
        from torchvision.transforms import v2

        return v2
    except ImportError:  # torchvision < 0.15
        from torchvision import transforms

        return transforms


def transform_names() -> list[str]:
    ns = _namespace()
    return sorted(n for n in dir(ns) if not n.startswith("_") and n not in _EXCLUDED
                  and isinstance(getattr(ns, n), type))


def _dtype(value: Any) -> Any:
    if isinstance(value, torch.dtype) or value is None:
        return value
    candidate = getattr(torch, str(value).replace("torch.", ""), None)
    if not isinstance(candidate, torch.dtype):
        raise UserError(f"torchvision_transforms: dtype {value!r} is not a torch dtype; use e.g. float32.")
    return candidate


def _interpolation(value: Any) -> Any:
    from torchvision.transforms import InterpolationMode

    if isinstance(value, InterpolationMode) or not isinstance(value, str):
        return value
    try:
        return InterpolationMode[value.upper()]
    except KeyError:
        names = [m.name.lower() for m in InterpolationMode]
        raise UserError(f"torchvision_transforms: interpolation {value!r} is unknown."
                        f"{did_you_mean(value.lower(), names)} Use one of {names}.") from None


def _is_spec(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, Mapping) and "type" in value)


def build_transform(spec: Any, where: str = "transforms") -> Any:
    """One ``{type, params}`` (or a bare name) of torchvision -> a transform instance."""
    name, params = component_spec(spec, f"torchvision_transforms: {where} entry")
    names = transform_names()
    if name not in names:
        raise UserError(f"torchvision_transforms: unknown transform {name!r} in {where}.{did_you_mean(name, names)} "
                        "Names are classes of torchvision.transforms.v2.")
    for key, value in list(params.items()):
        if key == "dtype":
            params[key] = _dtype(value)
        elif key == "interpolation":
            params[key] = _interpolation(value)
        elif isinstance(value, Sequence) and not isinstance(value, str) and value and all(map(_is_spec, value)) \
                and key in ("transforms",):
            params[key] = [build_transform(v, f"{where}.{name}.{key}") for v in value]
    try:
        return getattr(_namespace(), name)(**params)
    except (TypeError, ValueError) as e:
        raise UserError(f"torchvision_transforms: {name}({params}) is invalid: {e}") from None


@register_processor("torchvision_transforms")
class TorchvisionTransforms:
    """``processor(pil_image)`` -> float ``C x H x W`` tensor through the listed transforms."""

    def __init__(self, transforms: Sequence[Any] | None = None):
        specs = list(transforms or [])
        self.transforms = [build_transform(s, f"transforms[{i}]") for i, s in enumerate(specs)]

    def __call__(self, image: Any) -> torch.Tensor:
        for t in self.transforms:
            image = t(image)
        if not isinstance(image, torch.Tensor):
            import numpy as np

            try:
                array = np.asarray(image.convert("RGB"), dtype=np.uint8).copy()
            except AttributeError:
                raise UserError(f"torchvision_transforms: the pipeline returned a {type(image).__name__}, not an "
                                "image; end it with ToImage and ToDtype.") from None
            image = torch.from_numpy(array).permute(2, 0, 1)
        if not image.is_floating_point():
            image = image.float().div_(255.0)
        return image.as_subclass(torch.Tensor)  # a plain tensor, not a tv_tensors.Image

    def __repr__(self) -> str:
        return f"TorchvisionTransforms({self.transforms})"
