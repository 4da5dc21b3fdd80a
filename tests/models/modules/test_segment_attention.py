"""Packed rows' attention, each sample's own square: what the block-diagonal causal mask computes
(grouped-query heads too), and a model that installed it answers padded batches as before."""
from __future__ import annotations

import torch

from mmvl.data.packing import BUCKET_WASTE, attention_buckets
from mmvl.models.modules.segment_attention import NAME, attention, install
from mmvl.models.modules.vlm_parts import packed_attention_mask


class _Module(torch.nn.Module):
    pass


def test_each_sample_s_square_equals_the_block_diagonal_mask():
    torch.manual_seed(0)
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 0, 1, 0, 1, 2]])
    segments = [(0, 0, 3), (0, 3, 5), (0, 5, 9), (1, 0, 5), (1, 5, 7)]  # row 0's last and row 1's last 3: padding
    buckets = attention_buckets([(r * 10 + s, e - s) for r, s, e in segments])
    assert 1 < len(buckets["buckets"]) < len(segments)
    assert sorted(buckets["positions"].tolist()) == [r * 10 + p for r, s, e in segments for p in range(s, e)]
    q = torch.randn(2, 4, 10, 8, requires_grad=True)
    k, v = torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)  # 2 key/value heads for 4 query heads
    ours, _ = attention(_Module(), q, k, v, None, scaling=0.3, mmvl_segments=buckets)
    mask = packed_attention_mask(positions)
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                            attn_mask=mask, scale=0.3).transpose(1, 2)
    for row, start, end in segments:
        torch.testing.assert_close(ours[row, start:end], want[row, start:end])
    assert ours[0, 9].eq(0).all() and ours[1, 7:].eq(0).all()  # padding: nothing
    ours.square().sum().backward()
    assert q.grad[0, :, 9].eq(0).all() and q.grad[0, :, :9].ne(0).any()


def test_buckets_compute_little_more_than_the_samples_own_squares():
    lengths = [17, 150, 90, 91, 33, 140, 60, 61, 62, 120, 10, 100]
    spans, at = [], 0
    for n in lengths:
        spans.append((at, n))
        at += n
    buckets = attention_buckets(spans)
    computed = sum(b.shape[0] * b.shape[1] ** 2 for b in buckets["buckets"])
    assert computed <= BUCKET_WASTE * sum(n * n for n in lengths) and len(buckets["buckets"]) < len(lengths)


def test_a_model_that_installed_it_answers_padded_batches_as_sdpa_does():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 40, (2, 9))
    mask = torch.tensor([[1] * 9, [1] * 6 + [0] * 3])
    before = model(input_ids=ids, attention_mask=mask).logits
    assert install(model.config) and model.config._attn_implementation == NAME
    after = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(after, before)
    eager = LlamaConfig(**{**config.to_dict(), "attn_implementation": "eager"})
    assert not install(eager)  # eager attention keeps the mask
