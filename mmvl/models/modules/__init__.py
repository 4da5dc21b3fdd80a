"""Shared model building blocks (encoders, embeddings, heads)."""
from mmvl.models.modules.image_encoders import (  # noqa: F401
    IMAGE_ENCODERS, CNNEncoder, PatchEncoder, ResNetEncoder, build_image_encoder,
)

from mmvl.models.modules import timm_encoder  # noqa: F401,E402  (registers the timm image encoder)
from mmvl.models.modules import hf_vision  # noqa: F401,E402  (registers the transformers CLIP/SigLIP encoder)

__all__ = ["IMAGE_ENCODERS", "CNNEncoder", "PatchEncoder", "ResNetEncoder", "build_image_encoder"]
