"""``vqa_answer``: the answer vocabulary and soft-score targets of VQA-style datasets.

VQA v2 gives ten human answers per question. An answer given by ``n`` of them
scores ``min(n / 3, 1)``: the target is that soft score for every answer in the
vocabulary (the ``logit_bce`` loss and ``vqa_accuracy`` metric read it).
Answers are normalised lightly (lower case, punctuation and stray periods
removed, thousands separators dropped) before counting, as the official
evaluation does, without its number-word and article rewriting.
"""
from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch

from mmvl.errors import UserError
from mmvl.registry import register_processor

_PUNCT = re.compile(r"[;/\[\]\"{}()=+\\_\-><@`,?!]")  # the official evaluation's list
_THOUSANDS = re.compile(r"(?<=\d),(?=\d)")
_PERIOD = re.compile(r"(?<!\d)\.|\.(?!\d)")
_SPACES = re.compile(r"\s+")


def normalize_answer(answer: str) -> str:
    """``" Yes. "`` -> ``"yes"``, ``"2,000"`` -> ``"2000"``, ``"t-shirt"`` -> ``"t shirt"``, ``"3.5"`` kept."""
    text = str(answer).lower().replace("\n", " ").replace("\t", " ").strip()
    text = _THOUSANDS.sub("", text)
    text = _PUNCT.sub(" ", text)
    text = _PERIOD.sub("", text)
    return _SPACES.sub(" ", text).strip()


def soft_scores(answers: Iterable[str]) -> dict[str, float]:
    """Normalised answer -> ``min(#humans who gave it / 3, 1)``."""
    counts = Counter(normalize_answer(a) for a in answers)
    return {a: min(c / 3.0, 1.0) for a, c in counts.items() if a}


@register_processor("vqa_answer")
class VQAAnswerProcessor:
    """``processor(answers)`` -> ``{"targets": float [num_answers]}`` of soft scores.

    The vocabulary is the ``top_k`` most frequent normalised answers of
    ``answers`` (a dataset passes every human answer of its training split; ties
    in alphabetical order) kept when seen at least ``min_count`` times, or the
    lines of ``vocab_file``. Answers outside it score nothing. A dataset that has
    counted its answers already passes ``answer_counts`` (normalised answer ->
    number of human answers) instead of ``answers``: the same vocabulary, without
    normalising millions of strings again.
    """

    def __init__(self, answers: Iterable[Sequence[str]] | None = None, vocab_file: str | None = None,
                 top_k: int | None = 3129, min_count: int = 1, answer_counts: Mapping[str, int] | None = None):
        if vocab_file is not None:
            path = Path(os.path.expanduser(str(vocab_file)))
            if not path.is_file():
                raise UserError(f"vqa_answer: vocab_file {str(path)!r} does not exist; give a file with one "
                                "answer per line, or leave it null to build the vocabulary from training answers.")
            vocab = [normalize_answer(line) for line in path.read_text(encoding="utf-8").splitlines()]
            vocab = list(dict.fromkeys(a for a in vocab if a))
        elif answers is not None or answer_counts is not None:
            if top_k is not None and int(top_k) < 1:
                raise UserError(f"vqa_answer: top_k={top_k} must be a positive integer or null (keep all).")
            if answer_counts is not None:
                counts = Counter()
                for a, c in answer_counts.items():
                    counts[normalize_answer(a)] += int(c)
            else:
                counts = Counter(normalize_answer(a) for per_question in answers for a in per_question)
            counts.pop("", None)
            vocab = sorted((a for a, c in counts.items() if c >= int(min_count)), key=lambda a: (-counts[a], a))
            vocab = vocab[: int(top_k)] if top_k is not None else vocab
        else:
            raise UserError("vqa_answer: no answers to build a vocabulary from; set "
                            "processors.answer_processor.params.vocab_file or give the split annotations.")
        if not vocab:
            raise UserError("vqa_answer: the answer vocabulary is empty (min_count too high, or no answers).")
        self.vocab = vocab
        self.index = {a: i for i, a in enumerate(vocab)}

    @property
    def num_answers(self) -> int:
        return len(self.vocab)

    def answer(self, index: int) -> str:
        return self.vocab[int(index)]

    def save(self, path: str | os.PathLike) -> Path:
        """Write the vocabulary (one answer per line) for ``vocab_file``."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(self.vocab) + "\n", encoding="utf-8")
        return path

    def targets(self, indices: Sequence[int], counts: Sequence[int]) -> dict[str, torch.Tensor]:
        """Soft scores from answer-vocabulary ``indices`` and how many humans gave each (distinct indices)."""
        targets = torch.zeros(len(self.vocab), dtype=torch.float32)
        if len(indices):
            scores = np.minimum(np.asarray(counts, dtype=np.float64) / 3.0, 1.0)
            targets[torch.as_tensor(np.asarray(indices, dtype=np.int64))] = torch.from_numpy(scores).float()
        return {"targets": targets}

    def __call__(self, answers: Iterable[str]) -> dict[str, torch.Tensor]:
        targets = torch.zeros(len(self.vocab), dtype=torch.float32)
        for answer, score in soft_scores(answers).items():
            i = self.index.get(answer)
            if i is not None:
                targets[i] = score
        return {"targets": targets}
