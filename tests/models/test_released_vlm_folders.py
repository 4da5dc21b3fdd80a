"""The tiny released-VLM folders the ``hf_vlm`` work is tested on (tests/fixtures/released_vlms.py)
are what a user brings: transformers loads each offline through ``AutoModelForImageTextToText`` and
``AutoProcessor``; the processor renders the chat template (no ``{% generation %}`` marks), expands
the image placeholder into the model's image tokens and returns the architecture's extra keys; the
model scores the batch and generates; its vision tower, connector and language model sit where
transformers 5 names them."""
from __future__ import annotations

import pytest
import torch

from tests.fixtures.released_vlms import ARCHITECTURES

MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what color"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_a_tiny_folder_loads_offline_renders_expands_scores_and_generates(arch, tmp_path):
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    maker, parts, placeholder, extra = ARCHITECTURES[arch]
    folder = maker(tmp_path / arch)
    proc = AutoProcessor.from_pretrained(str(folder), local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(str(folder), local_files_only=True).eval()
    assert model.config.model_type == arch
    for name in parts:
        assert sum(p.numel() for p in model.get_submodule(name).parameters()) > 0, name
    assert "{% generation %}" not in proc.chat_template
    text = proc.apply_chat_template(MESSAGES, tokenize=False)
    assert text.count(placeholder) == 1 and text.rstrip().endswith(proc.tokenizer.eos_token)
    image = Image.new("RGB", (40, 40), (200, 30, 30))
    batch = proc(text=[text], images=[[image]], return_tensors="pt")
    assert set(extra) <= set(batch), sorted(batch)
    image_id = proc.tokenizer.convert_tokens_to_ids(placeholder)
    assert int(batch["input_ids"].eq(image_id).sum()) > 1  # the placeholder became the model's image tokens
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape[:2] == batch["input_ids"].shape and torch.isfinite(logits).all()
    prompt = proc(text=[proc.apply_chat_template(MESSAGES[:1], tokenize=False, add_generation_prompt=True)],
                  images=[[image]], return_tensors="pt")
    new = model.generate(**prompt, max_new_tokens=3, do_sample=False)
    assert prompt["input_ids"].shape[1] < new.shape[1] <= prompt["input_ids"].shape[1] + 3
    assert torch.equal(new[:, :prompt["input_ids"].shape[1]], prompt["input_ids"])
