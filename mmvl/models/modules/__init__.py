"""Shared model building blocks (encoders, embeddings, heads)."""
from mmvl.models.modules.image_encoders import (  # noqa: F401
    IMAGE_ENCODERS, CNNEncoder, PatchEncoder, ResNetEncoder, build_image_encoder,
)

__all__ = ["IMAGE_ENCODERS", "CNNEncoder", "PatchEncoder", "ResNetEncoder", "build_image_encoder"]
