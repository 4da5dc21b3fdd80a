"""bert_tokenizer masked-LM masking: BERT's 80/10/10 statistics, per-sample determinism, special
tokens, off by default, -100 padding in collated batches, and coco_captions' train-only masking."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from mmvl.data.base import DatasetBuilder
from mmvl.data.processors.text import BertTokenizerProcessor, write_word_vocab
from mmvl.labels import IGNORE_INDEX
from mmvl.errors import UserError
from mmvl.registry import DATASETS, PROCESSORS

WORDS = [f"w{i}" for i in range(300)]
LONG = " ".join(WORDS[i % 300] for i in range(400))


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    return write_word_vocab([" ".join(WORDS), "a red square on a blue background"],
                            tmp_path_factory.mktemp("vocab") / "vocab.txt")


def tok(vocab, p: float = 0.15, length: int = 512) -> BertTokenizerProcessor:
    return BertTokenizerProcessor(tokenizer_path=str(vocab), max_seq_length=length, mask_probability=p)


def test_registered_and_accepts_mask_probability():
    assert PROCESSORS.get("bert_tokenizer") is BertTokenizerProcessor


def test_masking_follows_berts_80_10_10_rule(vocab):
    proc = tok(vocab)
    plain = proc(LONG)["input_ids"]
    mask_id = proc.tokenizer.mask_token_id
    selected = masked = randomised = kept = maskable = 0
    for seed in range(20):
        out = proc(LONG, rng=[7, seed])
        labels, ids = out["lm_label_ids"], out["input_ids"]
        sel = labels.ne(IGNORE_INDEX)
        torch.testing.assert_close(labels[sel], plain[sel])  # labels are the original ids
        assert torch.equal(ids[~sel], plain[~sel])  # unselected tokens never change
        maskable += len(plain) - 2
        selected += int(sel.sum())
        masked += int((ids[sel] == mask_id).sum())
        kept += int((ids[sel] == plain[sel]).sum())
        randomised += int(((ids[sel] != mask_id) & (ids[sel] != plain[sel])).sum())
    assert selected / maskable == pytest.approx(0.15, abs=0.015)  # 7,980 tokens: sd 0.004
    assert masked / selected == pytest.approx(0.8, abs=0.04)
    assert randomised / selected == pytest.approx(0.1, abs=0.03)
    assert kept / selected == pytest.approx(0.1, abs=0.03)


def test_random_replacements_are_words_not_special_tokens(vocab):
    proc = tok(vocab, p=0.9)
    specials = set(proc.tokenizer.all_special_ids)
    for seed in range(5):
        out = proc(LONG, rng=seed)
        changed = out["input_ids"][out["lm_label_ids"].ne(IGNORE_INDEX)]
        assert not (set(changed.tolist()) & specials - {proc.tokenizer.mask_token_id})


def test_masking_is_a_function_of_the_seed(vocab):
    proc = tok(vocab)
    a, again = proc(LONG, rng=[0, 3, 1]), proc(LONG, rng=[0, 3, 1])
    for key in a:
        assert torch.equal(a[key], again[key])
    generator = proc(LONG, rng=np.random.default_rng([0, 3, 1]))
    assert torch.equal(generator["input_ids"], a["input_ids"])  # a Generator or its seed: the same draws
    other = proc(LONG, rng=[0, 3, 2])  # e.g. the next epoch
    assert not torch.equal(other["lm_label_ids"], a["lm_label_ids"])
    state = torch.get_rng_state(), np.random.get_state()[1].copy()
    proc(LONG, rng=5)
    assert torch.equal(torch.get_rng_state(), state[0])  # the global RNGs are neither used nor moved
    assert np.array_equal(np.random.get_state()[1], state[1])


def test_special_tokens_and_padding_are_never_masked(vocab):
    proc = tok(vocab, p=0.99, length=12)
    specials = set(proc.tokenizer.all_special_ids)
    for seed in range(30):
        out = proc("w1 unknownword w2 [SEP] w3 w4 w5 w6 w7 w8 w9 w10", rng=seed)  # [UNK], [SEP] inside, truncated
        plain = proc("w1 unknownword w2 [SEP] w3 w4 w5 w6 w7 w8 w9 w10")["input_ids"]
        special = torch.tensor([i in specials for i in plain.tolist()])
        assert special.sum() >= 4  # [CLS], [UNK], [SEP] (inner and last)
        assert out["lm_label_ids"][special].eq(IGNORE_INDEX).all()
        assert torch.equal(out["input_ids"][special], plain[special])
    pad = proc.tokenizer.pad_token_id
    assert pad in proc.special_ids  # padding (added by collate, or by a caller) is never selected


def test_masking_off_gives_identical_output(vocab):
    unmasked = BertTokenizerProcessor(tokenizer_path=str(vocab), max_seq_length=512)
    reference = unmasked(LONG)
    for out in (tok(vocab, p=0.0)(LONG, rng=1), tok(vocab)(LONG), unmasked(LONG, rng=1)):
        assert set(out) == {"input_ids", "attention_mask", "token_type_ids"}  # no lm_label_ids
        for key in out:
            assert torch.equal(out[key], reference[key])


def test_collated_batch_pads_labels_with_minus_100(vocab):
    proc = tok(vocab, p=0.5)
    items = [proc("w1 w2", rng=0), proc("w3 w4 w5 w6 w7 w8", rng=1)]
    batch = DatasetBuilder(OmegaConf.create({}), ".").collate(items)
    assert batch["lm_label_ids"].shape == batch["input_ids"].shape == (2, 8)
    assert batch["lm_label_ids"][0, 4:].eq(IGNORE_INDEX).all()  # padding: ignored by the loss
    assert batch["input_ids"][0, 4:].eq(0).all() and batch["attention_mask"][0, 4:].eq(0).all()


def test_bad_masking_settings(vocab, tmp_path):
    with pytest.raises(UserError, match="mask_probability=1.5"):
        tok(vocab, p=1.5)
    no_mask = tmp_path / "vocab.txt"
    no_mask.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\nred\n")
    try:  # transformers 5 appends [MASK] (and counts it in vocab_size); 4 has none to use
        proc = tok(no_mask, p=0.9)
    except UserError as e:
        assert "no [MASK] token" in str(e)
    else:
        ids = torch.cat([proc("red red red red", rng=s)["input_ids"] for s in range(5)])
        assert proc.tokenizer.mask_token_id in ids.tolist() and ids.max() < proc.vocab_size


# -- coco_captions: the dataset seeds the masking and keeps evaluation unmasked ----------------------
@pytest.fixture(scope="module")
def coco_dir(tmp_path_factory):
    from tests.fixtures.vl_data import write_coco_captions

    root = tmp_path_factory.mktemp("coco")
    write_coco_captions(root)
    return root


def coco(coco_dir, vocab, **overrides):
    import mmvl.data.datasets.coco_captions  # noqa: F401  (registers coco_captions)

    cfg = OmegaConf.load("configs/datasets/coco_captions.yaml").dataset_config.coco_captions
    cfg = OmegaConf.merge(cfg, {"image_size": 16, "mask_probability": 0.5, "processors": {"text_processor": {
        "type": "bert_tokenizer", "params": {"tokenizer_path": str(vocab), "max_seq_length": 16}}}}, overrides)
    return DATASETS.get("coco_captions")(cfg, str(coco_dir))


@pytest.fixture(scope="module")
def coco_vocab(tmp_path_factory, coco_dir):
    import json

    doc = json.loads((coco_dir / "coco" / "annotations" / "captions_train2014.json").read_text())
    return write_word_vocab([a["caption"] for a in doc["annotations"]], tmp_path_factory.mktemp("v") / "vocab.txt")


def test_coco_masks_train_only_seeded_by_index_and_epoch(coco_dir, coco_vocab):
    b = coco(coco_dir, coco_vocab)
    train = b.build("train")
    first = [train[i]["input_ids"] for i in range(len(train))]
    assert train[3]["input_ids"].equal(first[3])  # the same item again: the same masking
    batch = b.collate([train[i] for i in range(len(train))])
    assert batch["lm_label_ids"].shape == batch["input_ids"].shape
    assert batch["lm_label_ids"][batch["attention_mask"].eq(0)].eq(IGNORE_INDEX).all()
    assert batch["lm_label_ids"].ne(IGNORE_INDEX).any()
    train.set_epoch(1)  # what the train loader calls before each epoch
    assert any(not train[i]["input_ids"].equal(first[i]) for i in range(len(train)))
    train.set_epoch(0)
    assert all(train[i]["input_ids"].equal(first[i]) for i in range(len(train)))
    assert "lm_label_ids" not in b.build("val")[0]  # evaluation sees the text unmasked...
    assert "lm_label_ids" in coco(coco_dir, coco_vocab, mask_eval=True).build("val")[0]  # ...unless asked
    assert "lm_label_ids" not in coco(coco_dir, coco_vocab, mask_probability=0.0).build("train")[0]
