"""Conversations through a tokenizer's chat template (mmvl.data.processors.chat): the labels are
exactly the assistant turns' tokens and their end-of-turn token, against the template's own
rendering; without a template the plain layout, unchanged; bad conversations and templates refused."""
from __future__ import annotations

import pytest
import torch

from mmvl.data.processors.chat import image_first
from mmvl.errors import UserError
from mmvl.labels import IGNORE_INDEX
from tests.fixtures import tiny_vlm

TURNS = [{"role": "user", "content": "what is shown <image>"}, {"role": "assistant", "content": "a big red square"},
         {"role": "user", "content": "what color"}, {"role": "assistant", "content": "red"},
         {"role": "user", "content": "what shape"}, {"role": "assistant", "content": "the square left of the circle"}]


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    return tiny_vlm.make_chat_lm(tmp_path_factory.mktemp("chat") / "lm")


@pytest.fixture(scope="module")
def plain_folder(tmp_path_factory):
    return tiny_vlm.make_tiny_lm(tmp_path_factory.mktemp("plain") / "lm", layers=1)


def _tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def test_labels_are_exactly_the_assistant_turns_of_the_templates_own_rendering(chat_folder):
    tok, proc = _tokenizer(chat_folder), tiny_vlm.processor(chat_folder, max_length=128)
    out = proc.conversation(TURNS, has_image=True)
    ids, targets = out["input_ids"].tolist(), out["targets"].tolist()
    image = proc.tokenizer.image_id
    assert ids.count(image) == tiny_vlm.IMAGE_TOKENS
    at = ids.index(image)
    collapsed = ids[:at] + ids[at + tiny_vlm.IMAGE_TOKENS - 1:]  # one placeholder, as the template renders it
    rendered = tok.apply_chat_template(image_first(TURNS, "<image>"), tokenize=True)
    rendered = rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered
    assert collapsed == list(rendered)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    expected = [t for turn in TURNS if turn["role"] == "assistant"
                for t in tok(turn["content"], add_special_tokens=False)["input_ids"] + [end]]
    assert [t for t in targets if t != IGNORE_INDEX] == expected
    assert sum(t != IGNORE_INDEX for t in targets) == len(expected)
    labelled = [i for i, t in enumerate(targets) if t != IGNORE_INDEX]
    assert all(targets[i] == ids[i] for i in labelled)


def test_label_last_marks_only_the_final_answer_and_generation_stops_at_the_end_of_turn(chat_folder):
    tok, proc = _tokenizer(chat_folder), tiny_vlm.processor(chat_folder, max_length=128)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert proc.end_id == end == proc.model_info()["eos_token_id"] != tok.eos_token_id
    targets = proc.conversation(TURNS, has_image=True, label="last")["targets"].tolist()
    assert [t for t in targets if t != IGNORE_INDEX] == tok("the square left of the circle",
                                                           add_special_tokens=False)["input_ids"] + [end]
    assert proc.decode(tok("red square", add_special_tokens=False)["input_ids"] + [end, 5, 6]) == "red square"
    # a prompt alone ends with the template's generation prompt, unlabelled
    prompt = proc("what color")
    tail = tok.convert_ids_to_tokens(prompt["input_ids"].tolist()[-2:])
    assert tail == ["<|im_start|>", "assistant"] and prompt["targets"].eq(IGNORE_INDEX).all()
    answered = proc("what color", "red")["targets"].tolist()
    assert [t for t in answered if t != IGNORE_INDEX] == tok("red", add_special_tokens=False)["input_ids"] + [end]


def test_without_a_template_one_turn_is_the_prompt_answer_layout(plain_folder):
    proc = tiny_vlm.processor(plain_folder, max_length=64)
    assert proc.chat is None
    one = proc.conversation([{"role": "user", "content": "<image> what color"},
                             {"role": "assistant", "content": "red"}], has_image=True)
    same = proc("what color", "red")
    assert all(torch.equal(one[k], same[k]) for k in same)
    two = proc.conversation(TURNS, has_image=True)
    eos = proc.tokenizer.eos_token_id
    assert two["targets"].eq(eos).sum() == 3 and two["input_ids"].eq(proc.tokenizer.image_id).sum() == 4


@pytest.mark.parametrize("turns, has_image, needle", [
    ([{"role": "assistant", "content": "hi"}], False, "the first turn is not the user's"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}],
     False, "turn 1 is the user's after the user's"),
    ([{"role": "user", "content": "<image> a"}, {"role": "assistant", "content": "b"}], False,
     "<image> appears, but the sample has no image"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], True,
     "it has an image and 0 <image> placeholders"),
    ([{"role": "user", "content": "a"}], False, "ends with a user turn"),
    ([{"role": "user", "content": "<image> a"}, {"role": "assistant", "content": "b <image>"}], True,
     r"turn 1 \(the assistant's, gpt\) holds <image>"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "<image> b"}], True,
     r"turn 1 \(the assistant's, gpt\) holds <image>"),
])
def test_bad_conversations_are_refused(plain_folder, turns, has_image, needle):
    with pytest.raises(UserError, match=needle):
        tiny_vlm.processor(plain_folder).conversation(turns, has_image, where="sample 7")


def test_a_template_without_assistant_turns_is_refused_at_start(tmp_path):
    silent = "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}\n{% endif %}{% endfor %}"
    folder = tiny_vlm.make_chat_lm(tmp_path / "lm", template=silent)
    with pytest.raises(UserError, match="chat_template renders no assistant turn"):
        tiny_vlm.processor(folder)


def test_too_long_with_the_image_tokens(chat_folder):
    with pytest.raises(UserError, match="sample 3: .* tokens with the image tokens exceed max_length=20"):
        tiny_vlm.processor(chat_folder, max_length=20, on_too_long="error").conversation(TURNS, True, where="sample 3")
    cut = tiny_vlm.processor(chat_folder, max_length=20).conversation(TURNS, True)
    assert cut["input_ids"].numel() == 20 and cut["input_ids"].eq(4).sum() == tiny_vlm.IMAGE_TOKENS
