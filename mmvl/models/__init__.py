"""Registered models; importing this package registers them."""
from mmvl.models import visual_bert  # noqa: F401  (registers visual_bert)
from mmvl.models.base import BaseModel
from mmvl.models.visual_bert import VisualBert

__all__ = ["BaseModel", "VisualBert"]
from mmvl.models import concat_bert, mmbt  # noqa: F401,E402
from mmvl.models import relation_network  # noqa: F401,E402
from mmvl.models import clip  # noqa: F401,E402
from mmvl.models import vlm, hf_vlm  # noqa: F401,E402
