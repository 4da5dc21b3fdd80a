"""BERT gets no attention mask for a batch collate found unpadded (so sdpa may take the flash
kernel) and a mask when text or regions are padded; the decision reads no device value, the
forward copies nothing from the host, and the outputs with and without the mask agree."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from mmvl.data.sample import PADDED, collate
from mmvl.registry import MODELS
from tests.fixtures.copies import CopyCounter
from tests.fixtures.syncs import SyncCounter

TINY = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "classifier_dropout": 0.0,
        "vocab_size": 20, "num_labels": 5, "max_position_embeddings": 32,
        "image_encoder": {"type": "cnn", "params": {"channels": [8, 16], "strides": [4, 4]}}}
#: every BERT-based model, on pixels and on region features
CASES = {"visual_bert": ("visual_bert", {}), "visual_bert_regions": ("visual_bert", {"feature_dim": 6}),
         "visual_bert_exact": ("visual_bert", {"feature_dim": 6, "embeddings": "visual_bert"}),
         "mmbt_regions": ("mmbt", {"feature_dim": 6, "num_image_tokens": 2}),
         "concat_bert": ("concat_bert", {}), "concat_bert_regions": ("concat_bert", {"feature_dim": 6})}


def _model(case: str) -> torch.nn.Module:
    name, extra = CASES[case]
    torch.manual_seed(0)
    return MODELS.get(name)(OmegaConf.create({**TINY, **extra})).eval()


def _items(text_lengths: list[int], region_counts: list[int]) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    items = []
    for i, (length, regions) in enumerate(zip(text_lengths, region_counts)):
        ids = torch.randint(5, 20, (length,), generator=g)
        ids[0], ids[-1] = 2, 3  # [CLS] ... [SEP]
        items.append({"input_ids": ids, "attention_mask": torch.ones(length, dtype=torch.long),
                      "token_type_ids": torch.zeros(length, dtype=torch.long), "targets": i,
                      "image": torch.randn(3, 32, 32, generator=g), "features": torch.randn(regions, 6, generator=g),
                      "boxes": torch.rand(regions, 4, generator=g),
                      "feature_mask": torch.ones(regions, dtype=torch.long)})
    return items


@pytest.fixture
def attention_masks(monkeypatch):
    """The ``attn_mask`` of every sdpa call (None, or its shape) and whether any was causal."""
    seen: list = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        seen.append((None if attn_mask is None else tuple(attn_mask.shape), is_causal))
        return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return seen


@pytest.mark.parametrize("case", sorted(CASES))
def test_unpadded_batch_reaches_bert_without_a_mask_and_gives_the_same_scores(case, attention_masks):
    model = _model(case)
    batch = collate(_items([7, 7, 7], [4, 4, 4]))
    assert batch[PADDED] is False
    with torch.no_grad(), SyncCounter() as syncs, CopyCounter() as copies:
        fast = model(batch)["scores"]
    assert syncs.calls == [] and copies.calls == []  # the decision is a host bool: no device read
    assert attention_masks and all(m == (None, False) for m in attention_masks), attention_masks
    attention_masks.clear()
    with torch.no_grad():
        masked = model({**batch, PADDED: True})["scores"]  # the all-ones mask, as before the flag
    assert attention_masks and all(m is not None for m, _ in attention_masks)
    torch.testing.assert_close(fast, masked, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("padded", ["text", "regions"])
def test_padded_text_or_regions_reach_bert_with_a_mask(case, padded, attention_masks):
    """The mask covers text and visual tokens: either part padded means a mask (concat_bert's BERT sees
    the text only and gets its all-ones mask then)."""
    model = _model(case)
    lengths, regions = ([7, 5, 7], [4, 4, 4]) if padded == "text" else ([7, 7, 7], [4, 2, 4])
    batch = collate(_items(lengths, regions))
    assert batch[PADDED] is True
    with torch.no_grad(), SyncCounter() as syncs, CopyCounter() as copies:
        model(batch)
    assert syncs.calls == [] and copies.calls == []  # the mask comes from shapes and arithmetic only
    assert attention_masks and all(m is not None for m, _ in attention_masks), attention_masks


def test_a_batch_without_the_flag_keeps_its_mask(attention_masks):
    """A hand-built batch (not from collate) is never assumed unpadded."""
    batch = collate(_items([7, 7], [4, 4]))
    del batch[PADDED]
    with torch.no_grad():
        _model("visual_bert")(batch)
    assert attention_masks and all(m is not None for m, _ in attention_masks)


def test_mmbt_with_fewer_regions_than_image_tokens_keeps_the_mask(attention_masks):
    """An image token over no region is masked out even when no sample is padded."""
    model = _model("mmbt_regions")
    model.num_image_tokens = 3
    batch = collate(_items([7, 7], [2, 2]))
    assert batch[PADDED] is False
    with torch.no_grad():
        model(batch)
    assert attention_masks and all(m is not None for m, _ in attention_masks)
