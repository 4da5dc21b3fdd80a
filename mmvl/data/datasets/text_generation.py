"""What a dataset builder whose targets are generated text shares: the model's vocabulary from its
text processor, and prediction rows that carry their reference, so a predictions file scores itself
(:mod:`mmvl.metrics.generation`) without the dataset."""
from __future__ import annotations

import functools
from types import MappingProxyType
from typing import Any, Callable, Sequence

import torch

from mmvl.data.packing import pack, placed_images
from mmvl.data.processors.vlm_processor import IMAGES
from mmvl.errors import UserError
from mmvl.labels import IGNORE_INDEX

#: the text processors that write labelled answer tokens: mmvl's layout or a chat template
#: (``prompt_answer``), or a released VLM's own processor, which also makes the pixels (``hf_processor``)
ANSWER_PROCESSORS = ("prompt_answer", "hf_processor")


def takes_images(text_processor: Any) -> bool:
    """Whether the text processor makes the pixels itself (a released VLM's processor)."""
    return bool(getattr(text_processor, "takes_images", False))


def visual_sample(text_processor: Any, image_processor: Any, images: Sequence[Any], *, turns: Any = None,
                  prompt: str = "", answer: str | None = None, label: str = "all", where: str = "sample",
                  blank: Any = None) -> dict[str, Any]:
    """One sample's tokens and pixels: a conversation (``turns``) or a ``prompt`` and its ``answer``,
    about ``images`` (raw: decoded files or pixel arrays). A processor that takes images makes the
    pixels; otherwise ``image_processor`` makes ``image`` of the one image (``blank`` without one)."""
    if takes_images(text_processor):
        if turns is not None:
            return text_processor.conversation(turns, list(images), label, where)
        return text_processor(prompt, answer, images=list(images))
    if len(images) > 1 and turns is None:
        raise UserError(f"{where}: {len(images)} images for one prompt; give a conversation with one <image> each.")
    out = (text_processor.conversation(turns, len(images), label, where) if turns is not None
           else text_processor(prompt, answer))
    if len(images) > 1:  # images x C x H x W: the model places them at the placeholders in order
        out["image"] = torch.stack([image_processor(image) for image in images])
    else:
        out["image"] = image_processor(images[0]) if images else blank
    return out


def row_images(processor: Any, rows: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """``images``: a released VLM processor's image tensors of packed rows, each row's samples' tensors
    joined in their order, then batched by kind as the processor batches samples (a row is one sample
    to it: its per-image keys concatenated, its per-sample keys padded to the row with the most)."""
    joined = []
    for row in rows:
        parts = [item[IMAGES] for item in row if item.get(IMAGES) is not None]
        joined.append({key: torch.cat([p[key] for p in parts], 0) for key in parts[0]} if parts else None)
    batch = processor.collate_images(joined)
    return {} if batch is None else {IMAGES: batch}


class GeneratesText:
    """Mixed into a builder with a ``text_processor`` (``prompt_answer`` or ``hf_processor``) and
    samples with an ``answer``."""

    #: the padding of a batch's token labels is ignored by the loss, never learnt as a token
    pad_values = MappingProxyType({"targets": IGNORE_INDEX})

    @property
    def text_processor(self) -> Any:
        """The builder's processor of labelled answer tokens (:data:`ANSWER_PROCESSORS`)."""
        kind = ((self.cfg.get("processors") or {}).get("text_processor") or {}).get("type")  # type: ignore[attr-defined]
        if kind not in ANSWER_PROCESSORS:
            name = self.name  # type: ignore[attr-defined]
            raise UserError(f"dataset_config.{name}.processors.text_processor.type={kind!r}; {name} needs prompt_answer "
                            "(or hf_processor, a released VLM's own, for model hf_vlm).")
        return super().text_processor  # type: ignore[misc]  # the builder's processor cache

    def collate(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        """The base builder's batch, its padding positions holding the tokenizer's pad id; the image
        tensors of a processor that makes them batched by their kind (``images``)."""
        processor = self.text_processor
        images = [item.get(IMAGES) for item in items]
        if takes_images(processor):
            items = [{k: v for k, v in item.items() if k != IMAGES} for item in items]
        pixels = [item.get("image") for item in items]
        if any(isinstance(p, torch.Tensor) and p.dim() == 4 for p in pixels):  # several images in a sample
            items = [dict(item, image=p.unsqueeze(0)) if isinstance(p, torch.Tensor) and p.dim() == 3 else item
                     for item, p in zip(items, pixels)]
        batch = super().collate(items)  # type: ignore[misc]  # the builder this is mixed into
        pad = processor.model_info()["pad_token_id"]
        batch["input_ids"] = batch["input_ids"].masked_fill(batch["attention_mask"].eq(0), pad)
        if takes_images(processor):
            joined = processor.collate_images(images)
            if joined is not None:
                batch[IMAGES] = joined
        return batch

    def packer(self, length: int | None = None) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
        """The collate of ``training.packing``: the samples in shared rows of up to ``length`` tokens
        (``training.packing_length``; None: one row of them all; :mod:`mmvl.data.packing`)."""
        processor = self.text_processor
        if length is not None and int(length) < int(processor.max_length):
            raise UserError(f"training.packing_length={length} is shorter than dataset {self.name}'s max_length="  # type: ignore[attr-defined]
                            f"{processor.max_length} (a sample may be that long); set it to at least "
                            f"{processor.max_length}, or null.")
        info = processor.model_info()
        if takes_images(processor):  # a released VLM's processor: its image tensors batched by their kinds, row by row
            images: Callable[..., dict[str, Any]] = functools.partial(row_images, processor)
        else:
            images = functools.partial(placed_images, image_token_id=int(info["image_token_id"]),
                                       image_tokens=int(info["image_tokens"]))
        return functools.partial(pack, capacity=None if length is None else int(length), pad_id=int(info["pad_token_id"]),
                                 images=images)

    def model_info(self) -> dict[str, int]:
        return self.text_processor.model_info()

    def generated_text(self, ids: Any) -> list[str]:
        """Generated token ids (``B x new``, from the model's ``generate``) -> one text a sample, as
        the generation metrics and the predictions file read it."""
        return [self.text_processor.decode(row) for row in ids.tolist()]

    def predictions(self, data: dict[str, Any], scores: Any) -> list[dict[str, Any]]:
        """``[{"id", "answer", "reference"}]``: the decoded generated text (``scores`` are generated ids)
        and the true answer or caption."""
        ids = data.get("id", [])
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return [{"id": i, "answer": text, "reference": ref}
                for i, text, ref in zip(ids, self.generated_text(scores), data["answer"])]

    def extra_metrics(self, split: str) -> dict[str, float]:
        """None: generated text is scored from the predictions file (BLEU-4, CIDEr, ROUGE-L)."""
        return {}
