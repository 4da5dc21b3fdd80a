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


#: interpolations whose transformers counterpart is the same resampling (PIL's codes, as image processors read them)
_RESAMPLE = {"NEAREST": 0, "BILINEAR": 2, "BICUBIC": 3}
#: transforms that only change the image's type
_CONVERSIONS = {"ToImage", "PILToTensor", "ToPureTensor"}


def hf_image_processor_kwargs(transforms: Sequence[Any] | None, where: str) -> dict[str, Any]:
    """A ``torchvision_transforms`` list as the arguments of a transformers image processor
    (``CLIPImageProcessor``) that makes the same pixels: a Resize to a fixed height and width, the
    scaling to [0, 1], a Normalize. Anything else is refused in one line naming it (an exported model
    would see other pixels than it trained on). A Resize of the decoded image (before ``ToImage``)
    resamples with PIL, transformers 5 with torch: pixels then differ by up to one grey level; after
    ``ToImage`` they are equal."""
    kwargs: dict[str, Any] = {"do_resize": False, "do_center_crop": False, "do_rescale": True,
                              "rescale_factor": 1 / 255, "do_normalize": False, "do_convert_rgb": True}
    scaled = False
    for i, spec in enumerate(transforms or []):
        name, params = component_spec(spec, f"{where}[{i}]")
        if name in _CONVERSIONS:
            continue
        if name == "Resize" and not scaled:
            size = params.get("size")
            interp = str(params.get("interpolation", "bilinear")).upper().replace("INTERPOLATIONMODE.", "")
            if not (isinstance(size, Sequence) and len(size) == 2) or interp not in _RESAMPLE \
                    or params.get("antialias", True) is False or kwargs["do_resize"]:
                raise UserError(f"{where}: Resize({params}) has no transformers equivalent; resize once to [height, "
                                f"width] with interpolation {' | '.join(m.lower() for m in _RESAMPLE)} (antialias on).")
            kwargs.update(do_resize=True, size={"height": int(size[0]), "width": int(size[1])},
                          resample=_RESAMPLE[interp])
        elif name == "ToDtype" and params.get("scale") and str(params.get("dtype", "")).endswith("float32"):
            scaled = True
        elif name == "Normalize" and scaled and not kwargs["do_normalize"]:
            kwargs.update(do_normalize=True, image_mean=[float(v) for v in params["mean"]],
                          image_std=[float(v) for v in params["std"]])
        else:
            raise UserError(f"{where}: {name} (transform {i}) has no transformers image processor equivalent here; an "
                            "exportable pipeline is Resize([H, W]), ToImage, ToDtype(float32, scale), Normalize.")
    return kwargs
