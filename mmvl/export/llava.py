"""A run of mmvl's own ``vlm`` as transformers' ``LlavaForConditionalGeneration`` (``mmvl_export hf``).

``vlm`` is LLaVA's design, so a run of it maps onto LLaVA when its parts are LLaVA's: an
``hf_vision`` tower (CLIP or SigLIP; the layers it read, ``vision_feature_layer`` as indices from
the embeddings, the same select strategy), no ``pixel_shuffle`` or ``summary_token``, the 2-layer
GELU projector (``net.0`` / ``net.2`` -> ``linear_1`` / ``linear_2``) and any transformers causal
LM (its base model and head). Anything else is refused in one line naming what blocks it.

The processor is a ``LlavaProcessor`` that makes the run's samples: the tokenizer its
``prompt_answer`` used (a chat template is required: the plain layout has no transformers
counterpart), an image processor equal to the dataset's ``torchvision_transforms``, and a chat
template that first turns structured content (``{"type": "image"}`` items, what lmms-eval and
vLLM send) into the text the run rendered (each image's placeholder on its own line ahead of the
turn's text), then applies the tokenizer's own template.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mmvl.adapters import merge_lora
from mmvl.build import ModelSection, model_from
from mmvl.checkpoint import load_checkpoint, schema
from mmvl.data.processors.image import hf_image_processor_kwargs
from mmvl.errors import UserError

#: turns a message's structured content into the text a ``prompt_answer`` run rendered; IMAGE is the placeholder
STRUCTURED = (
    "{%- set mmvl = namespace(messages=[]) -%}"
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set mmvl.messages = mmvl.messages + [message] -%}"
    "{%- else -%}{%- set turn = namespace(images='', texts=[]) -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{%- set turn.images = turn.images + 'IMAGE\\n' -%}"
    "{%- elif item['type'] == 'text' -%}{%- set turn.texts = turn.texts + [item['text']] -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- set mmvl.messages = mmvl.messages + [{'role': message['role'], "
    "'content': turn.images + (turn.texts | join('\\n')) | trim}] -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- set messages = mmvl.messages -%}")


def blockers(model_cfg: Mapping[str, Any]) -> list[str]:
    """What keeps a ``vlm`` of ``model_cfg`` from being LLaVA's architecture (none: it maps)."""
    encoder = (model_cfg.get("image_encoder") or {}).get("type", "cnn")
    found = []
    if encoder != "hf_vision":
        found.append(f"image_encoder {encoder} (LLaVA's is a transformers tower: hf_vision)")
    if int(model_cfg.get("pixel_shuffle") or 1) != 1:
        found.append(f"pixel_shuffle {model_cfg.get('pixel_shuffle')} (LLaVA's is 1)")
    if model_cfg.get("summary_token"):
        found.append("summary_token true")
    if int(model_cfg.get("projector_layers") or 2) != 2:
        found.append(f"projector_layers {model_cfg.get('projector_layers')} (LLaVA's is 2)")
    return found


def text_section(config: Mapping[str, Any]) -> tuple[str, dict[str, Any], Any]:
    """``(dataset, its prompt_answer params, its image transforms)``: how the run made its samples."""
    for name, section in (config.get("dataset_config") or {}).items():
        processors = (section or {}).get("processors") or {}
        text = processors.get("text_processor") or {}
        if text.get("type") == "prompt_answer":
            image = processors.get("image_processor") or {}
            if image.get("type") != "torchvision_transforms":
                raise UserError(f"mmvl_export hf: dataset {name}'s image_processor is {image.get('type')!r}; a vlm run "
                                "exports with a torchvision_transforms pipeline (it becomes the folder's image processor).")
            return name, dict(text.get("params") or {}), (image.get("params") or {}).get("transforms")
    raise UserError("mmvl_export hf: no dataset of the run made its samples with prompt_answer; a vlm run exports "
                    "the tokenizer of its prompt_answer text processor.")


def vlm_as_llava(config: Mapping[str, Any], model_cfg: Mapping[str, Any], checkpoint: Path) -> tuple[Any, Any, Any]:
    """``(LlavaForConditionalGeneration with the run's weights, its LlavaProcessor, the run's
    prompt_answer processor)`` of the ``vlm`` run whose config is ``config``."""
    found = blockers(model_cfg)
    if found:
        raise UserError(f"mmvl_export hf: this vlm does not map onto LLaVA ({'; '.join(found)}); train it with "
                        "model_config.vlm.image_encoder.type=hf_vision, pixel_shuffle 1, no summary_token and "
                        "projector_layers 2 (projects/vlm/configs/llava/clip.yaml).")
    from mmvl.data.processors.prompt_answer import PromptAnswerProcessor

    dataset, params, transforms = text_section(config)
    if not params.get("tokenizer_path"):
        raise UserError(f"mmvl_export hf: dataset {dataset}'s prompt_answer has no tokenizer_path (a word vocabulary "
                        "transformers cannot load); train with the LM folder's tokenizer (and its chat template).")
    text = PromptAnswerProcessor(**params)
    if text.chat is None:
        raise UserError(f"mmvl_export hf: the tokenizer in {str(params['tokenizer_path'])!r} has no chat_template, and "
                        "the plain prompt_answer layout has no transformers processor; train with a tokenizer that has one.")
    where = f"dataset_config.{dataset}.processors.image_processor.params.transforms"
    image = hf_image_processor_kwargs(transforms, where)  # refused before the weights load
    model = _vlm(model_cfg, {dataset: text}, checkpoint)
    return _llava(model), _processor(model, text, image, where), text


def _vlm(model_cfg: Mapping[str, Any], info: Mapping[str, Any], checkpoint: Path) -> Any:
    """The run's ``vlm``, built as the run built it (its nulls filled from ``info``: what gives
    ``model_info()``, its text processor; adapters in), with the checkpoint's weights, LoRA merged."""
    from mmvl.models import vlm  # noqa: F401  (registers the model)
    from mmvl.models.modules.vlm_parts import quiet_loading

    with quiet_loading():
        model = model_from(ModelSection("vlm", model_cfg), info)
    adapted = bool((model_cfg.get("lora") or {}).get("r"))
    state = load_checkpoint(checkpoint)[schema.MODEL]
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise UserError(f"mmvl_export hf: {str(checkpoint)!r} does not fit the run's vlm ({len(missing)} weights missing, "
                        f"{len(unexpected)} unknown, e.g. {(list(missing) or list(unexpected))[0]!r}); is it this run's?")
    return merge_lora(model) if adapted else model


def _llava(model: Any) -> Any:
    """A ``LlavaForConditionalGeneration`` holding ``model``'s weights."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    encoder, lm = model.image_encoder, model.lm
    layers = encoder.layers[0] if len(encoder.layers) == 1 else list(encoder.layers)
    config = LlavaConfig(vision_config=encoder.model.config, text_config=lm.config, image_token_id=model.image_token_id,
                         projector_hidden_act="gelu", vision_feature_layer=layers,
                         vision_feature_select_strategy=encoder.strategy, multimodal_projector_bias=True,
                         image_seq_length=encoder.tokens_per_image(),
                         tie_word_embeddings=bool(getattr(lm.config, "tie_word_embeddings", False)))
    llava = LlavaForConditionalGeneration(config).eval()
    inner = llava.model
    inner.vision_tower.load_state_dict(encoder.model.state_dict())
    inner.multi_modal_projector.linear_1.load_state_dict(model.projector.net[0].state_dict())
    inner.multi_modal_projector.linear_2.load_state_dict(model.projector.net[2].state_dict())
    inner.language_model.load_state_dict(lm.base_model.state_dict())
    llava.lm_head.load_state_dict(lm.get_output_embeddings().state_dict())
    return llava


def structured_template(template: str, image_token: str) -> str:
    """``template`` preceded by :data:`STRUCTURED` for the placeholder ``image_token``."""
    if any(c in image_token for c in "'\\{}%"):
        raise UserError(f"mmvl_export hf: the image placeholder {image_token!r} cannot be written into a chat template; "
                        "train with a placeholder of plain characters (e.g. <image>).")
    return STRUCTURED.replace("IMAGE", image_token) + template


def _processor(model: Any, text: Any, image: dict[str, Any], where: str) -> Any:
    """The ``LlavaProcessor`` that makes the run's samples (see the module's doc); ``image``: the image
    processor's arguments from the dataset's transforms (``where``)."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    encoder = model.image_encoder
    side = encoder.image_size
    if not image["do_resize"]:  # the run's images all had the tower's size: resizing to it changes none of them
        image.update(do_resize=True, size={"height": side, "width": side}, resample=3)
    if image["size"] != {"height": side, "width": side}:
        raise UserError(f"mmvl_export hf: {where} resizes to {image['size']}, and the tower takes {side}x{side}; is "
                        "this the run's config?")
    tokenizer = text.tokenizer.tok
    template = structured_template(str(tokenizer.chat_template), text.image_token)
    tokenizer.chat_template = template
    return LlavaProcessor(image_processor=CLIPImageProcessor(**image), tokenizer=tokenizer,
                          patch_size=encoder.patch_size, vision_feature_select_strategy=encoder.strategy,
                          chat_template=template, image_token=text.image_token,
                          num_additional_image_tokens=encoder.extra_tokens)
