"""``hf_processor``: samples for a released VLM (``model: hf_vlm``) through the processor of its folder.

The folder's ``AutoProcessor`` does what only it knows: its chat template renders the conversation
(each ``<image>`` of the data becomes an image item, which the template writes as the model's
placeholder), and its own expansion turns each placeholder into that image's tokens (576 for
LLaVA-1.5; tiles with row and column tokens for Idefics3; a number that follows the image's size
for Qwen2-VL) while its image processor makes the pixels and whatever else the model reads
(``image_grid_thw``, ``pixel_attention_mask``, ``token_type_ids``, ...).

Labels come from the rendering-difference method of :mod:`mmvl.data.processors.chat` (no template
marks needed): the text is tokenised piece by piece with the placeholders unexpanded, then the
i-th placeholder is replaced by what the processor makes of the i-th image alone, so the labelled
tokens are each assistant turn's content and its end-of-turn token, and image tokens are never
labelled. A prefix LM (PaliGemma) reads ``token_type_ids`` 1 as the causal suffix: it is set from
the first labelled token on, so no answer token sees a later one.

The processor's image outputs are of two kinds, found once by a probe of two images: *per image*
(rows that the model concatenates over the batch: LLaVA's ``pixel_values``, Qwen2-VL's patches
and ``image_grid_thw``) and *per sample* (a leading batch axis, images padded: Idefics3's tiles).
:meth:`VLMProcessor.collate_images` batches each by its kind.
"""
from __future__ import annotations

import os
from typing import Any, Iterable, Sequence

import torch

from mmvl.data.processors.chat import ChatTemplate, check_turns, labelled_turns
from mmvl.errors import UserError, library_input
from mmvl.labels import IGNORE_INDEX
from mmvl.registry import register_processor

#: the placeholder the data writes for each image (LLaVA's)
IMAGE_TOKEN = "<image>"
POLICIES = ("cut_text", "error")
#: the processors whose ``token_type_ids`` mark the causal suffix of a prefix LM (1: attends causally)
PREFIX_LM_PROCESSORS = ("PaliGemmaProcessor",)
#: what the processor returns that mmvl makes itself (tokens, mask, labels) or never passes
_TEXT_KEYS = ("input_ids", "attention_mask", "labels")
#: the files a processor's save_pretrained writes its image processor to (transformers 5, and 4)
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
#: the batch key holding the image tensors, the key inside it with each per-image key's rows per sample, and the
#: flag of a batch without images whose tensors are a blank image's, placed nowhere (see ``collate_images``)
IMAGES, ROWS, UNPLACED = "images", "rows", "unplaced"


def check_vlm_folder(path: Any, where: str) -> None:
    """``path`` is a local folder, and where it holds a model (``config.json``), an image-text-to-text
    one: a text-only LM's folder is refused, pointing to ``model: vlm`` (which composes one)."""
    if not path or not os.path.isdir(str(path)):
        raise UserError(f"{where}={path!r} is not a folder; give a local transformers VLM folder (config.json, "
                        "weights and processor, e.g. written by save_pretrained). Nothing downloads.")
    if not os.path.isfile(os.path.join(str(path), "config.json")):
        return  # a processor's folder alone: no model to check
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    with library_input(f"{where}={str(path)!r} does not load", "give a folder written by save_pretrained."):
        kind = getattr(AutoConfig.from_pretrained(str(path), local_files_only=True), "model_type", None)
    if kind not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        raise UserError(f"{where}={str(path)!r} holds a {kind} model, not an image-text-to-text VLM; for a causal "
                        "LM use model: vlm with model_config.vlm.language_model.path set to it.")


def load_processor(path: Any, where: str) -> Any:
    """The ``AutoProcessor`` of a local folder, refused in one line when it is not a VLM's (nothing
    downloads)."""
    check_vlm_folder(path, f"{where}: path")
    if not any(os.path.isfile(os.path.join(str(path), name)) for name in PROCESSOR_FILES):
        raise UserError(f"{where}: {str(path)!r} has no VLM processor (none of {', '.join(PROCESSOR_FILES)}); save the "
                        "model's AutoProcessor there with save_pretrained.")
    from transformers import AutoProcessor

    with library_input(f"{where}: the processor in {str(path)!r} does not load",
                       "save one there with processor.save_pretrained(folder)."):
        processor = AutoProcessor.from_pretrained(str(path), local_files_only=True)
    if getattr(processor, "image_processor", None) is None or getattr(processor, "tokenizer", None) is None:
        raise UserError(f"{where}: {str(path)!r} has no VLM processor (a tokenizer and an image processor: "
                        "preprocessor_config.json); save the model's AutoProcessor there with save_pretrained.")
    if not getattr(processor, "chat_template", None):
        raise UserError(f"{where}: the processor in {str(path)!r} has no chat template; set processor.chat_template "
                        "(the model card's, or a Jinja template) and save_pretrained it (chat_template.jinja).")
    return processor


@register_processor("hf_processor")
class VLMProcessor:
    """``conversation(turns, images, label, where)`` and ``processor(prompt, answer, images)`` ->
    ``input_ids``, ``attention_mask``, ``targets``, the processor's per-token keys and ``images``
    (its image tensors for the sample)."""

    #: datasets hand this processor the images themselves (it makes the pixels)
    takes_images = True

    def __init__(self, path: str, max_length: int = 1024, on_too_long: str = "cut_text", image_token: str = IMAGE_TOKEN):
        where = "hf_processor"
        if on_too_long not in POLICIES:
            raise UserError(f"{where}: on_too_long={on_too_long!r}; use one of {', '.join(POLICIES)}.")
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise UserError(f"{where}: max_length={max_length!r}; give a number of tokens, e.g. 2048.")
        self.path, self.max_length, self.on_too_long, self.image_token = str(path), max_length, on_too_long, image_token
        self.processor = load_processor(path, where)
        self.tok = self.processor.tokenizer
        model_token = getattr(self.processor, "image_token", None) or image_token
        self.model_token = str(model_token)
        self.model_token_id = int(self.tok.convert_tokens_to_ids(self.model_token))
        self.chat = ChatTemplate(self.processor, f"{where}: {self.path!r}", tokenizer=self.tok, image_token=image_token)
        self.prefix_lm = type(self.processor).__name__ in PREFIX_LM_PROCESSORS
        pad = self.tok.pad_token_id
        self.pad_token_id = int(pad if pad is not None else self.chat.end_id)
        self._counts: dict[tuple[int, int], int] = {}  # image size -> its tokens (image_token_count)
        self._probe()

    def _probe(self) -> None:
        """What the processor makes of a blank image and of two in one sample: each image key's kind
        (``image``: rows concatenated over the batch; ``sample``: a batch axis) and trailing shape,
        whether it takes several images a sample (if not, every key is ``image`` and several are
        refused), its per-token keys, and about how many tokens an image takes (``length``)."""
        from PIL import Image

        picture = Image.new("RGB", (224, 224), (127, 127, 127))
        one = self._call([picture])
        try:
            two = self._call([picture, picture])
        except Exception:  # noqa: BLE001 - an architecture of one image a sample
            two = None
        #: whether the processor takes several images a sample
        self.several = two is not None
        image_keys = set(self.processor.image_processor(images=[picture], return_tensors="pt").keys()) & set(one)
        self.kinds = {key: "sample" if two is not None and two[key].shape[0] == 1 else "image" for key in image_keys}
        self.trailing = {key: tuple(one[key].shape[2 if kind == "sample" else 1:]) for key, kind in self.kinds.items()}
        #: the processor's per-token keys besides the tokens and their mask (e.g. token_type_ids)
        self.token_keys = [k for k in one if k not in _TEXT_KEYS and k not in self.kinds]
        #: one blank image's tensors, the model's batch layout: what a batch without images carries, unplaced
        self._unplaced = {key: one[key] for key in self.kinds}
        self.image_tokens = int(one["input_ids"].shape[1])

    def _call(self, images: Sequence[Any]) -> Any:
        with library_input("hf_processor: the processor does not take the image", "give RGB images it can read."):
            return self.processor(text=[self.model_token * len(images)], images=[list(images)],
                                  add_special_tokens=False, return_tensors="pt")

    # -- what the model and the datasets read -------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    @property
    def end_id(self) -> int:
        """The template's end-of-turn token: labelled after each answer; generation stops at it."""
        return self.chat.end_id

    def model_info(self) -> dict[str, Any]:
        """Filled into ``model_config.hf_vlm``'s null keys: the ids decoding needs and this folder."""
        return {"eos_token_id": self.end_id, "pad_token_id": self.pad_token_id, "processor": self.path}

    def length(self, texts: Iterable[str], has_image: bool | int) -> int:
        """About a sample's tokens (``training.group_by_length`` sorts by it; no tokenizer runs)."""
        words = sum(len(str(text).split()) + 1 for text in texts)
        return min(self.max_length, words + self.image_tokens * int(has_image) + 1)

    def decode(self, ids: list[int]) -> str:
        ids = list(ids)
        ids = ids[: ids.index(self.end_id)] if self.end_id in ids else ids
        return str(self.tok.decode(ids, skip_special_tokens=True)).strip()

    # -- samples ------------------------------------------------------------------------------------
    def __call__(self, prompt: str, answer: str | None = None, images: Sequence[Any] = ()) -> dict[str, Any]:
        """One question (its images ahead of it) and its answer; ``answer=None``: the prompt alone,
        up to the generation prompt."""
        turns = self.prompt_turns(prompt, answer, len(images))
        if answer is None:
            ids, mask = self.chat.tokens(turns, [False], generation_prompt=True)
            return self._sample(ids, mask, list(images), "hf_processor")
        return self.conversation(turns, images)

    def prompt_turns(self, prompt: str, answer: str | None, images: int) -> list[dict[str, str]]:
        """A question (its images' placeholders ahead of it) and its answer as turns."""
        turns = [{"role": "user", "content": self.image_token * images + f"\n{prompt}"}]
        return turns if answer is None else turns + [{"role": "assistant", "content": answer}]

    def conversation(self, turns: list[dict[str, str]], images: Sequence[Any], label: str = "all",
                     where: str = "hf_processor") -> dict[str, Any]:
        """``turns`` (user first, alternating, ending with the assistant; one ``<image>`` in the user
        turns per image, in order) with every assistant turn labelled (``label: all``) or the last."""
        images = list(images)
        check_turns(turns, len(images), self.image_token, where)
        if len(images) > 1 and not self.several:
            raise UserError(f"{where}: {len(images)} images, and the processor in {self.path!r} takes one image a "
                            "sample; give one image per sample.")
        ids, mask = self.chat.tokens(turns, labelled_turns(turns, label))
        return self._sample(ids, mask, images, where)

    def image_token_count(self, size: tuple[int, int]) -> int:
        """How many tokens the processor makes of an image of ``size`` (width, height): the count follows
        the size alone (tiles, dynamic resolution), so a blank image of that size tells it."""
        if size not in self._counts:
            from PIL import Image

            self._counts[size] = int(self._call([Image.new("RGB", size)])["input_ids"].shape[1])
        return self._counts[size]

    def planned_length(self, turns: list[dict[str, str]], sizes: Sequence[tuple[int, int]],
                       label: str = "all") -> tuple[int, int]:
        """``(tokens, end of the last image's tokens)`` of the sample these turns and image sizes make,
        before ``max_length``: the text tokenised, each image counted by its size."""
        ids, _ = self.chat.tokens(turns, labelled_turns(turns, label))
        at = [i for i, v in enumerate(ids) if v == self.model_token_id]
        counts = [self.image_token_count((int(size[0]), int(size[1]))) for size in sizes]
        return len(ids) - len(at) + sum(counts), (at[-1] + 1 - len(at) + sum(counts)) if at else 0

    def check_fits(self, turns: list[dict[str, str]], sizes: Sequence[tuple[int, int]], label: str, where: str) -> None:
        """Refuse, before any training, a sample that ``on_too_long`` cannot take: with ``cut_text`` one
        whose image tokens would end after ``max_length``; with ``error`` one longer than it. Exact
        without decoding pixels: the text is tokenised, and each image counts the tokens of its size."""
        check_turns(turns, len(sizes), self.image_token, where)
        total, image_end = self.planned_length(turns, sizes, label)
        if self.on_too_long == "error" and total > self.max_length:
            raise UserError(f"{where}: {total} tokens with the image tokens exceed max_length={self.max_length}; "
                            "raise max_length or set on_too_long: cut_text.")
        if image_end > self.max_length:
            raise UserError(f"{where}: its image tokens end at token {image_end}, after max_length={self.max_length}; "
                            "raise max_length (image tokens are never cut).")

    def _sample(self, ids: list[int], mask: list[bool], images: list[Any], where: str) -> dict[str, Any]:
        """Each rendered placeholder expanded into its image's tokens, held to ``max_length``."""
        at = [i for i, v in enumerate(ids) if v == self.model_token_id]
        if len(at) != len(images):
            raise UserError(f"{where}: the chat template renders {len(at)} image placeholders for {len(images)} "
                            f"images; the template must write one {self.model_token} per image item.")
        extra: dict[str, list[int]] = {key: [] for key in self.token_keys}
        pixels: dict[str, list[torch.Tensor]] = {key: [] for key in self.kinds}
        out_ids: list[int] = []
        out_mask: list[bool] = []
        start = 0
        for pos, image in zip(at, images):
            made = self._call([image])
            grown = made["input_ids"][0].tolist()
            for key in self.token_keys:
                extra[key] += [0] * (len(out_ids) + pos - start - len(extra[key])) + made[key][0].tolist()
            out_ids += ids[start:pos] + grown
            out_mask += mask[start:pos] + [False] * len(grown)
            for key, kind in self.kinds.items():
                pixels[key].append(made[key][0] if kind == "sample" else made[key])
            start = pos + 1
        out_ids += ids[start:]
        out_mask += mask[start:]
        for key in extra:
            extra[key] += [0] * (len(out_ids) - len(extra[key]))
        return self._tensors(out_ids, out_mask, extra, pixels, images, where)

    def _tensors(self, ids: list[int], mask: list[bool], extra: dict[str, list[int]],
                 pixels: dict[str, list[torch.Tensor]], images: list[Any], where: str) -> dict[str, Any]:
        if len(ids) > self.max_length:
            image_ends = max((i for i, m in enumerate(ids) if m == self.model_token_id), default=-1)
            if self.on_too_long == "error":
                raise UserError(f"{where}: {len(ids)} tokens with the image tokens exceed max_length="
                                f"{self.max_length}; raise max_length or set on_too_long: cut_text.")
            if image_ends >= self.max_length:
                raise UserError(f"{where}: its image tokens end at token {image_ends + 1}, after max_length="
                                f"{self.max_length}; raise max_length (image tokens are never cut).")
            ids, mask = ids[: self.max_length], mask[: self.max_length]
            extra = {k: v[: self.max_length] for k, v in extra.items()}
        tensor = torch.tensor(ids, dtype=torch.long)
        labelled = torch.tensor(mask, dtype=torch.bool)
        item: dict[str, Any] = {"input_ids": tensor, "attention_mask": torch.ones_like(tensor),
                                "targets": torch.where(labelled, tensor, torch.full_like(tensor, IGNORE_INDEX))}
        for key, values in extra.items():
            item[key] = torch.tensor(values, dtype=torch.long)
        if self.prefix_lm:  # the suffix (from the first answer token on) attends causally
            after = labelled.long().cumsum(0).gt(0).long()
            item["token_type_ids"] = torch.maximum(item.get("token_type_ids", torch.zeros_like(tensor)), after)
        if images:
            item[IMAGES] = {key: torch.cat(parts, 0) for key, parts in pixels.items()}
        return item

    # -- batches ------------------------------------------------------------------------------------
    def collate_images(self, samples: list[dict[str, torch.Tensor] | None]) -> dict[str, Any] | None:
        """The samples' image tensors as one batch: ``image`` keys concatenated (their per-sample row
        counts under ``rows``, so a batch can be cut to its first samples), ``sample`` keys padded
        with zeros to the most images and stacked (a sample without images: all zeros, which the
        models skip). A batch without any image carries a blank image's tensors marked ``unplaced``:
        a model whose every part must run in each forward (sharded) encodes it and adds nothing."""
        if all(s is None for s in samples):  # no image: the probe's, unplaced, for a model that must run its tower
            return {UNPLACED: True, ROWS: {}, **self._unplaced}
        batch: dict[str, Any] = {ROWS: {}}
        for key, kind in self.kinds.items():
            parts = [s[key] if s is not None else torch.zeros((0, *self.trailing[key])) for s in samples]
            if kind == "image":
                batch[key] = torch.cat([p.to(parts[0].dtype) for p in parts if p.numel()] or parts[:1], 0)
                batch[ROWS][key] = tuple(int(p.shape[0]) for p in parts)
            else:
                like = next(p for p in parts if p.numel())
                out = like.new_zeros((len(parts), max(p.shape[0] for p in parts), *like.shape[1:]))
                for i, p in enumerate(parts):
                    out[i, : p.shape[0]] = p
                batch[key] = out
        return batch


def first_images(images: dict[str, Any], n: int) -> dict[str, Any]:
    """A batch's ``images`` cut to its first ``n`` samples (per-image keys by their rows; a blank
    image placed nowhere stays as it is)."""
    if images.get(UNPLACED):
        return dict(images)
    rows = images.get(ROWS, {})
    out: dict[str, Any] = {ROWS: {k: counts[:n] for k, counts in rows.items()}}
    for key, value in images.items():
        if key == ROWS:
            continue
        out[key] = value[: sum(rows[key][:n])] if key in rows else value[:n]
    return out


__all__ = ["IMAGES", "ROWS", "UNPLACED", "VLMProcessor", "check_vlm_folder", "first_images", "load_processor"]
