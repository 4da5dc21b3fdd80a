"""``vocab``: a word-level vocabulary for text encoders trained from scratch.

Built from the training texts (a dataset passes them in as ``texts``) or read
from a file with one token per line. Its output matches ``bert_tokenizer``'s
(``[CLS] words [SEP]`` ids, attention mask, token types, unpadded), so any
model takes either processor; the special tokens come first with BERT's names.
"""
from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path
from typing import Iterable

import torch

from mmvl.errors import UserError
from mmvl.registry import register_processor

PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
SPECIAL_TOKENS = [PAD, UNK, CLS, SEP, MASK]
_WORD = re.compile(r"\w+|[^\w\s]", re.UNICODE)


def tokenize(text: str, lowercase: bool = True) -> list[str]:
    """Words and single punctuation marks: ``"Is it red?"`` -> ``["is", "it", "red", "?"]``."""
    return _WORD.findall(text.lower() if lowercase else text)


@register_processor("vocab")
class VocabProcessor:
    """``processor(text)`` -> ``input_ids``, ``attention_mask``, ``token_type_ids`` (1-D long tensors).

    Give ``vocab_file`` (one token per line, must contain ``[PAD]`` and ``[UNK]``)
    or ``texts``; words seen fewer than ``min_count`` times, or beyond the
    ``max_size`` most frequent, map to ``[UNK]``. Ties keep alphabetical order, so
    the same texts always give the same ids.
    """

    def __init__(self, vocab_file: str | None = None, texts: Iterable[str] | None = None,
                 max_seq_length: int = 32, min_count: int = 1, max_size: int | None = None,
                 lowercase: bool = True):
        if int(max_seq_length) < 3:
            raise UserError(f"vocab processor: max_seq_length={max_seq_length} is too short; use at least 3.")
        if int(min_count) < 1:
            raise UserError(f"vocab processor: min_count={min_count} must be at least 1.")
        self.max_seq_length = int(max_seq_length)
        self.lowercase = bool(lowercase)
        if vocab_file is not None:
            tokens = self._read(vocab_file)
        elif texts is not None:
            tokens = self._from_texts(texts, int(min_count), max_size)
        else:
            raise UserError("vocab processor: give vocab_file (one token per line) or a dataset that passes "
                            "its training texts; set processors.text_processor.params.vocab_file.")
        self.itos = tokens
        self.stoi = {t: i for i, t in enumerate(tokens)}
        self.pad_id, self.unk_id = self.stoi[PAD], self.stoi[UNK]
        self.cls_id, self.sep_id = self.stoi.get(CLS), self.stoi.get(SEP)

    def _from_texts(self, texts: Iterable[str], min_count: int, max_size: int | None) -> list[str]:
        counts = Counter(w for text in texts for w in tokenize(str(text), self.lowercase))
        words = sorted((w for w, c in counts.items() if c >= min_count and w not in SPECIAL_TOKENS),
                       key=lambda w: (-counts[w], w))
        if max_size is not None:
            words = words[: max(0, int(max_size) - len(SPECIAL_TOKENS))]
        return SPECIAL_TOKENS + words

    @staticmethod
    def _read(vocab_file: str | os.PathLike) -> list[str]:
        path = Path(os.path.expanduser(str(vocab_file)))
        if not path.is_file():
            raise UserError(f"vocab processor: vocab_file {str(path)!r} does not exist; give a file with one "
                            "token per line.")
        tokens = [line.rstrip("\r\n") for line in path.read_text(encoding="utf-8").splitlines()]
        tokens = [t for t in tokens if t]
        missing = [t for t in (PAD, UNK) if t not in tokens]
        if missing:
            raise UserError(f"vocab processor: {str(path)!r} lacks the special tokens {missing}; add them "
                            f"(the first lines are usually {' '.join(SPECIAL_TOKENS)}).")
        if len(set(tokens)) != len(tokens):
            dup = next(t for t in tokens if tokens.count(t) > 1)
            raise UserError(f"vocab processor: {str(path)!r} lists the token {dup!r} more than once.")
        return tokens

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the vocabulary (one token per line) so a later run can load it as ``vocab_file``."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(self.itos) + "\n", encoding="utf-8")
        return path

    def encode(self, text: str) -> list[int]:
        ids = [self.stoi.get(w, self.unk_id) for w in tokenize(str(text), self.lowercase)]
        specials = [i for i in (self.cls_id, self.sep_id) if i is not None]
        ids = ids[: self.max_seq_length - len(specials)]
        if self.cls_id is not None:
            ids = [self.cls_id] + ids
        if self.sep_id is not None:
            ids = ids + [self.sep_id]
        return ids

    def __call__(self, text: str) -> dict[str, torch.Tensor]:
        ids = torch.tensor(self.encode(text), dtype=torch.long)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
