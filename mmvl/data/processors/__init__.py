"""Registered processors; importing this package registers them."""
from mmvl.data.processors import text  # noqa: F401  (registers bert_tokenizer)
from mmvl.data.processors.text import BertTokenizerProcessor
from mmvl.data.features.processor import FeaturesProcessor  # noqa: F401  (registers "features")

__all__ = ["BertTokenizerProcessor", "text"]
from mmvl.data.processors import answers, image, vocab  # noqa: F401,E402  (registers vqa_answer, torchvision_transforms, vocab)
from mmvl.data.processors import prompt_answer, vlm_processor  # noqa: F401,E402  (registers prompt_answer, hf_processor)
