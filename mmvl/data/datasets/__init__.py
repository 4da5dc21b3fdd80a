"""Registered datasets; importing this package registers them."""
from mmvl.data import processors  # noqa: F401  (datasets build their processors by name)
from mmvl.data.datasets import sort_of_clevr  # noqa: F401  (registers sort_of_clevr)
from mmvl.data.datasets.sort_of_clevr import SortOfClevrBuilder, SortOfClevrDataset

__all__ = ["SortOfClevrBuilder", "SortOfClevrDataset"]
from mmvl.data.datasets import coco_captions, easy_vqa, hateful_memes, image_text_shards, vqa2  # noqa: F401,E402
from mmvl.data.datasets import easy_vqa_generative, hf_dataset, llava, sort_of_clevr_generative  # noqa: F401,E402
