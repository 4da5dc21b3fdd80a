"""The generative VLM (``model: vlm``) on a tiny random Llama saved to a temporary folder: masking,
truncation that never cuts image tokens, the answer-token loss normalised over the whole update
(accumulation == one big batch), and batched greedy/beam decoding with the KV cache."""
from __future__ import annotations

import copy

import pytest
import torch

from mmvl.errors import UserError
from mmvl.labels import IGNORE_INDEX
from mmvl.losses import AnswerTokensLoss
from tests.fixtures import tiny_vlm
from tests.fixtures.tiny_vlm import IMAGE_TOKENS


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return tiny_vlm.make_tiny_lm(tmp_path_factory.mktemp("tiny_lm"))


@pytest.fixture(scope="module")
def proc(lm):
    return tiny_vlm.processor(lm)


def test_only_answer_tokens_are_labelled(proc):
    t = proc.tokenizer
    item = proc("what is shown", "a big red square")
    ids, targets = item["input_ids"].tolist(), item["targets"].tolist()
    answer = t.encode("a big red square") + [t.eos_token_id]
    assert ids[0] == t.bos_token_id and ids[1:1 + IMAGE_TOKENS] == [t.image_id] * IMAGE_TOKENS
    assert ids[-len(answer):] == answer and targets[-len(answer):] == answer
    assert targets[:-len(answer)] == [IGNORE_INDEX] * (len(ids) - len(answer))  # bos, image, prompt
    batch = tiny_vlm.collate(proc, [item, proc("what color", "red")])
    short = batch["targets"][1]
    assert (short[batch["attention_mask"][1].eq(0)] == IGNORE_INDEX).all()  # padding is never labelled
    assert batch["input_ids"][1, -1] == t.pad_token_id


def test_truncation_cuts_text_never_image_tokens(lm):
    t_len = 1 + IMAGE_TOKENS + 3
    cut = tiny_vlm.processor(lm, max_length=t_len)
    item = cut("what is left of the square", "a small blue circle")
    ids = item["input_ids"].tolist()
    assert len(ids) == t_len and ids.count(cut.tokenizer.image_id) == IMAGE_TOKENS
    longer = cut("what", "a small blue circle")  # the prompt fits: the answer's tail is cut
    assert longer["input_ids"].tolist().count(cut.tokenizer.image_id) == IMAGE_TOKENS
    assert longer["targets"].ne(IGNORE_INDEX).sum() == 2
    refuse = tiny_vlm.processor(lm, max_length=t_len, on_too_long="error")
    with pytest.raises(UserError, match="max_length"):
        refuse("what is left of the square", "a small blue circle")
    assert refuse("what", "red")["input_ids"].numel() <= t_len
    with pytest.raises(UserError, match="image tokens are never cut"):
        tiny_vlm.processor(lm, max_length=IMAGE_TOKENS)


def test_image_tokens_reach_the_lm(lm, proc):
    model = tiny_vlm.build_model(lm, proc)
    batch = tiny_vlm.collate(proc, tiny_vlm.items(proc)[:2])
    scores = model(batch)["scores"]
    assert scores.shape == (*batch["input_ids"].shape, model.lm.config.vocab_size)
    other = dict(batch, image=batch["image"] + 1.0)
    changed = (model(other)["scores"] - scores).abs().amax(-1)[0]
    assert changed[:1].max() < 1e-6 and changed[1 + IMAGE_TOKENS:].min() > 0  # causal: bos before the image


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_accumulation_equals_one_big_batch(lm, proc):
    items = tiny_vlm.items(proc)
    micro = [tiny_vlm.collate(proc, items[i:i + 2]) for i in range(0, 8, 2)]
    big = tiny_vlm.collate(proc, items)
    model = tiny_vlm.build_model(lm, proc)
    other = copy.deepcopy(model)
    loss = AnswerTokensLoss()

    loss.begin_update([big])
    whole = loss(big, other(big))
    whole.backward()

    loss.begin_update(micro)
    parts = []
    for b in micro:  # Engine.backward divides each micro-batch's loss by the accumulation count
        value = loss(b, model(b)) / len(micro)
        value.backward()
        parts.append(value.detach())
    torch.testing.assert_close(sum(parts), whole.detach(), atol=1e-5, rtol=1e-5)
    ref, got = _grads(other), _grads(model)
    assert set(ref) == set(got) and len(ref) == len(list(model.parameters()))
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], atol=1e-5, rtol=1e-5, msg=name)

    # the per-micro-batch mean (what begin_update replaces) is measurably another gradient
    naive = AnswerTokensLoss()
    model.zero_grad()
    for b in micro:
        (naive(b, model(b)) / len(micro)).backward()
    assert max((_grads(model)[n] - ref[n]).abs().max() for n in ref) > 1e-3


def test_without_begin_update_a_batch_is_its_own_mean(lm, proc):
    model = tiny_vlm.build_model(lm, proc)
    batch = tiny_vlm.collate(proc, tiny_vlm.items(proc)[:3])
    scores = model(batch)["scores"]
    expected = torch.nn.functional.cross_entropy(scores[:, :-1].reshape(-1, scores.size(-1)),
                                                 batch["targets"][:, 1:].reshape(-1))
    torch.testing.assert_close(AnswerTokensLoss()(batch, {"scores": scores}), expected)


@pytest.mark.parametrize("beams", [1, 3])
def test_batched_decoding_equals_one_by_one(lm, proc, beams):
    model = tiny_vlm.build_model(lm, proc).eval()
    items = tiny_vlm.items(proc, prompt_only=True)[:4]  # prompts of different lengths: left-aligned inside
    batched = model.generate(tiny_vlm.collate(proc, items), num_beams=beams, max_new_tokens=5)
    assert batched.shape == (4, 5)
    for i, item in enumerate(items):
        alone = model.generate(tiny_vlm.collate(proc, [item]), num_beams=beams, max_new_tokens=5)
        assert alone[0].tolist() == batched[i].tolist(), i


def test_greedy_decoding_follows_the_argmax(lm, proc):
    """The KV-cached decoding picks what a full forward's argmax picks at every step."""
    model = tiny_vlm.build_model(lm, proc).eval()
    item = tiny_vlm.items(proc, prompt_only=True)[0]
    new = model.generate(tiny_vlm.collate(proc, [item]), max_new_tokens=4)[0].tolist()
    ids = item["input_ids"].tolist()
    for token in new:
        batch = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
                 "image": item["image"][None]}
        with torch.no_grad():
            scores = model(batch)["scores"][0, -1]
        scores[model.image_token_id] = float("-inf")  # decoding never writes an image placeholder
        expect = int(scores.argmax())
        assert token == expect
        if token == model.eos_token_id:
            break
        ids.append(token)


def test_a_labelled_batch_is_decoded_from_its_prompt(lm, proc):
    model = tiny_vlm.build_model(lm, proc).eval()
    labelled = tiny_vlm.collate(proc, tiny_vlm.items(proc)[:4])
    prompts = tiny_vlm.collate(proc, tiny_vlm.items(proc, prompt_only=True)[:4])
    assert model.generate(labelled).tolist() == model.generate(prompts).tolist()


def test_gradient_checkpointing_gives_the_same_gradients(lm, proc):
    batch = tiny_vlm.collate(proc, tiny_vlm.items(proc)[:3])
    grads = []
    for checkpointing in (False, True):
        model = tiny_vlm.build_model(lm, proc).train()
        if checkpointing:
            model.enable_gradient_checkpointing()
        AnswerTokensLoss()(batch, model(batch)).backward()
        grads.append(_grads(model))
    assert set(grads[0]) == set(grads[1])
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("tie", [False, True, None])
def test_a_random_lm_ties_its_embeddings_when_asked(lm, proc, tie):
    """``language_model.random.tie_word_embeddings``: one matrix reads the words in and scores them out
    (what the image tokens learn to say is the vector the question's word brings), else two; null
    leaves it to the model type (llama: two)."""
    random = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "tie_word_embeddings": tie}
    model = tiny_vlm.build_model(lm, proc, **{"language_model.path": None},
                                 **{f"language_model.random.{k}": v for k, v in random.items()})
    words_in, words_out = model.lm.get_input_embeddings().weight, model.lm.get_output_embeddings().weight
    assert (words_out is words_in) == bool(tie)
    names = {name for name, _ in model.named_parameters()}
    assert any(name.endswith("lm_head.weight") for name in names) != bool(tie)  # a tied head is not a second parameter


def test_a_summary_token_is_the_grid_mean_ahead_of_the_grid(lm, proc):
    """``summary_token: true``: one more image token, the projected mean of the grid's tokens, ahead of
    the grid's own (unchanged); the processor then writes one more placeholder, and a batch runs."""
    from mmvl.data.processors.prompt_answer import PromptAnswerProcessor
    from mmvl.models.modules.vlm_parts import grid_tokens

    plain = tiny_vlm.build_model(lm, proc)
    proc5 = PromptAnswerProcessor(image_tokens=IMAGE_TOKENS + 1, tokenizer_path=str(lm))
    summary = tiny_vlm.build_model(lm, proc5, summary_token=True)
    summary.load_state_dict(plain.state_dict())  # no new parameters: the same projector reads the mean
    pixels = torch.randn(2, 3, tiny_vlm.IMAGE_SIZE, tiny_vlm.IMAGE_SIZE)
    tokens = summary.image_tokens(pixels)
    assert tokens.shape[1] == IMAGE_TOKENS + 1
    torch.testing.assert_close(tokens[:, 1:], plain.image_tokens(pixels))
    grid = grid_tokens(plain.image_encoder(pixels), plain.shuffle)
    torch.testing.assert_close(tokens[:, 0], plain.projector(grid.mean(1)))
    batch = tiny_vlm.collate(proc5, tiny_vlm.items(proc5)[:2])
    assert summary(batch)["scores"].shape[:2] == batch["input_ids"].shape


@pytest.mark.parametrize("summary", [False, True])
def test_image_tokens_other_than_the_placeholders_are_refused(lm, proc, summary):
    """A processor writing another number of placeholders than the image gives tokens would have
    the splice drop or repeat tokens silently: the first forward names the number to set."""
    model = tiny_vlm.build_model(lm, proc, summary_token=summary, image_tokens=IMAGE_TOKENS + 2)
    batch = tiny_vlm.collate(proc, tiny_vlm.items(proc)[:2])
    with pytest.raises(UserError, match=rf"image_tokens={IMAGE_TOKENS + 2} placeholders; .*image_tokens="
                                        rf"{IMAGE_TOKENS + summary}\b"):
        model(batch)
    with pytest.raises(UserError, match="summary_token='yes'"):
        tiny_vlm.build_model(lm, proc, summary_token="yes")
    with pytest.raises(UserError, match=r"image_tokens=-1 must be an integer of 1 or more"):
        tiny_vlm.build_model(lm, proc, image_tokens=-1)
    text_only = tiny_vlm.build_model(lm, proc, summary_token=summary, image_tokens=0)  # no placeholders: unchecked
    assert text_only(batch)["scores"].shape[:2] == batch["input_ids"].shape
