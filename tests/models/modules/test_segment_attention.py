"""Packed rows' attention, each sample's own square: what the block-diagonal causal mask computes
(grouped-query heads too), and a model that installed it answers padded batches as before."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from mmvl.data import packing
from mmvl.data.packing import BUCKET_CALL, attention_buckets, bucket_groups
from mmvl.models.modules.segment_attention import NAME, attention, install
from mmvl.models.modules.vlm_parts import packed_attention_mask


class _Module(torch.nn.Module):
    pass


def test_each_sample_s_square_equals_the_block_diagonal_mask(monkeypatch):
    """Outputs and the gradients of query, key and value (whose backward is a gather, not a scatter-add)."""
    monkeypatch.setattr(packing, "BUCKET_CALL", 0)  # calls free: a bucket a length, for these short samples
    torch.manual_seed(0)
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 0, 1, 0, 1, 2]])
    segments = [(0, 0, 3), (0, 3, 5), (0, 5, 9), (1, 0, 5), (1, 5, 7)]  # row 0's last and row 1's last 3: padding
    buckets = attention_buckets([(r * 10 + s, e - s) for r, s, e in segments], 20)
    assert 1 < len(buckets["shapes"]) < len(segments)
    real = torch.ones(buckets["gather"].numel(), dtype=torch.bool).index_fill_(0, buckets["pad_slots"], False)
    assert sorted(buckets["gather"][real].tolist()) == [r * 10 + p for r, s, e in segments for p in range(s, e)]
    assert buckets["row_pads"].tolist() == [9, 17, 18, 19]
    q = torch.randn(2, 4, 10, 8, requires_grad=True)
    k, v = torch.randn(2, 2, 10, 8, requires_grad=True), torch.randn(2, 2, 10, 8, requires_grad=True)  # 2 kv heads
    ours, _ = attention(_Module(), q, k, v, None, scaling=0.3, mmvl_segments=buckets)
    weight = torch.randn(ours.shape)
    (ours * weight).sum().backward()
    mine = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    mask = packed_attention_mask(positions)
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                            attn_mask=mask, scale=0.3).transpose(1, 2)
    for row, start, end in segments:
        torch.testing.assert_close(ours[row, start:end], want[row, start:end])
    assert ours[0, 9].eq(0).all() and ours[1, 7:].eq(0).all()  # padding: nothing
    keep = torch.ones(2, 10)
    keep[0, 9] = keep[1, 7:] = 0  # the reference's padding rows attend themselves: not compared
    (want * weight * keep[:, :, None, None]).sum().backward()
    for got, t in zip(mine, (q, k, v)):
        torch.testing.assert_close(got, t.grad)
    assert mine[0][0, :, 9].eq(0).all() and mine[1][1, :, 7:].eq(0).all() and mine[0][0, :, :9].ne(0).any()


def _partitions(items: list[int]) -> Iterator[list[list[int]]]:
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        yield [[first], *part]
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1:]]


def _cost(lengths: list[int], groups: list[list[int]], call: int) -> int:
    return sum(len(g) * max(lengths[i] for i in g) ** 2 + call for g in groups)


@pytest.mark.parametrize("call", [0, 30 * 30, BUCKET_CALL, 10 ** 6])
def test_buckets_are_the_split_that_computes_least(call):
    """Against every way of splitting 8 samples (4,140 of them), for calls free to dear."""
    lengths = [17, 150, 90, 91, 33, 140, 60, 61]
    groups = bucket_groups(lengths, call)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert _cost(lengths, groups, call) == min(_cost(lengths, p, call) for p in _partitions(list(range(8))))
    if call == 0:
        assert len(groups) == len(set(lengths))  # padding costs, calls do not: one bucket a length
    if call == 10 ** 6:
        assert len(groups) == 1


def test_the_packer_s_buckets_follow_bucket_groups():
    lengths = [17, 150, 90, 91, 33, 140, 60, 61, 62, 120, 10, 100]
    spans, at = [], 0
    for n in lengths:
        spans.append((at, n))
        at += n
    buckets = attention_buckets(spans)
    want = [(len(g), max(lengths[i] for i in g)) for g in bucket_groups(lengths)]
    assert buckets["shapes"] == want and 1 < len(want) < len(lengths)
    assert buckets["row_pads"].numel() == 0 and buckets["scatter"].numel() == at


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
