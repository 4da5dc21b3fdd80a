"""Sort-of-CLEVR as generation (``datasets: [sort_of_clevr_generative]``): the answer is written.

The same generated images and questions as ``sort_of_clevr``; an item is the image, the question
as the prompt and the answer word as text to generate (``prompt_answer`` tokens: only the answer
is labelled). It is the offline workload of a generative VLM (``model: vlm``): every test and the
docs' tiny run train on it without downloading anything. With ``evaluation.predict`` the model
decodes from each item's prompt (its tokens before the first answer token).
"""
from __future__ import annotations

from typing import Any

from mmvl.config.components import build_component, component_spec
from mmvl.data.datasets.sort_of_clevr import ANSWERS, SortOfClevrBuilder, SortOfClevrDataset, all_questions
from mmvl.data.processors import prompt_answer as _prompt_answer  # noqa: F401  (registers prompt_answer)
from mmvl.data.datasets.text_generation import GeneratesText
from mmvl.errors import UserError
from mmvl.registry import PROCESSORS, register_dataset

_TEXT = "dataset_config.sort_of_clevr_generative.processors.text_processor"


class GenerativeItems(SortOfClevrDataset):
    """Items: ``image``, ``input_ids``, ``attention_mask``, ``targets`` (token labels), ``answer`` (text), ids."""

    def __getitem__(self, index: int) -> dict[str, Any]:
        qtype = int(self.types[index])
        item: dict[str, Any] = self.visual(int(self.image_rows[index]))
        answer = ANSWERS[int(self.answers[index])]
        item.update(self.text_processor(self.texts[index], answer))
        item.update(answer=answer, question_type=qtype, id=int(self.ids[index]), image_id=int(self.image_rows[index]))
        return item


@register_dataset("sort_of_clevr_generative")
class SortOfClevrGenerativeBuilder(GeneratesText, SortOfClevrBuilder):
    """Sort-of-CLEVR whose answers are generated text (a VLM's offline task)."""

    config_path = "datasets/sort_of_clevr_generative.yaml"

    def __init__(self, config, data_dir: str):
        super().__init__(config, data_dir)
        if self.regions is not None:
            raise UserError("sort_of_clevr_generative: regions must be null (a VLM reads pixels).")

    @property
    def text_processor(self):
        if self._processor is None:
            kind, params = component_spec((self.config.get("processors") or {}).get("text_processor"), _TEXT)
            if kind != "prompt_answer":
                raise UserError(f"{_TEXT}.type={kind!r}; sort_of_clevr_generative needs prompt_answer.")
            self._processor = build_component(PROCESSORS, {"type": kind, "params": params}, where=_TEXT,
                                              defaults={"texts": lambda: all_questions() + ANSWERS})
        return self._processor

    def build(self, split: str):
        data = super().build(split)
        data.__class__ = GenerativeItems
        return data
