"""Scores of generated text: caption metrics and VQA accuracy of generated answers.

Both take what ``mmvl_predict`` writes for a generative model: candidates ``{id: text}`` and
references ``{id: [texts]}``. Caption metrics (BLEU-4, CIDEr, ROUGE-L) are pycocoevalcap's own
scorers, which need no Java for these three (its PTB tokenizer does; here texts are lower-cased
and split on words and punctuation instead); it is imported only when used (``pip install
'mmvl[captions]'``). VQA accuracy applies the official answer normalisation (punctuation as
:func:`mmvl.data.processors.answers.normalize_answer`, then number words to digits and articles
dropped) and scores ``min(#references equal to the answer / 3, 1)``.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from mmvl.data.processors.answers import normalize_answer
from mmvl.errors import UserError

_NUMBERS = {"none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5",
            "six": "6", "seven": "7", "eight": "8", "nine": "9", "ten": "10"}
_ARTICLES = {"a", "an", "the"}
_WORDS = re.compile(r"\w+|[^\w\s]", re.UNICODE)


def normalize_vqa(answer: str) -> str:
    """The official VQA normalisation: punctuation, then number words -> digits, articles dropped."""
    words = [_NUMBERS.get(w, w) for w in normalize_answer(answer).split()]
    return " ".join(w for w in words if w not in _ARTICLES)


def vqa_accuracy(candidates: Mapping[Any, str], references: Mapping[Any, Sequence[str]]) -> float:
    """Mean over ``candidates`` of ``min(#references matching / 3, 1)`` after :func:`normalize_vqa`;
    a single reference (a generated dataset's one answer) scores 1 when it matches."""
    _check(candidates, references)
    total = 0.0
    for key, answer in candidates.items():
        refs = [normalize_vqa(r) for r in references[key]]
        hits = refs.count(normalize_vqa(answer))
        total += min(hits / min(3.0, len(refs)), 1.0) if refs else 0.0
    return total / max(1, len(candidates))


def _tokens(text: str) -> str:
    return " ".join(_WORDS.findall(str(text).lower()))


def caption_scores(candidates: Mapping[Any, str], references: Mapping[Any, Sequence[str]]) -> dict[str, float]:
    """``{"bleu4", "cider", "rouge_l"}`` of ``candidates`` against ``references`` (corpus-level,
    pycocoevalcap's scorers on word/punctuation tokens)."""
    _check(candidates, references)
    try:
        from pycocoevalcap.bleu.bleu import Bleu
        from pycocoevalcap.cider.cider import Cider
        from pycocoevalcap.rouge.rouge import Rouge
    except ImportError:
        raise UserError("caption metrics need pycocoevalcap: pip install 'mmvl[captions]'.") from None
    res = {k: [_tokens(v)] for k, v in candidates.items()}
    gts = {k: [_tokens(r) for r in references[k]] for k in candidates}
    bleu = Bleu(4).compute_score(gts, res, verbose=0)[0][3]
    return {"bleu4": float(bleu), "cider": float(Cider().compute_score(gts, res)[0]),
            "rouge_l": float(Rouge().compute_score(gts, res)[0])}


def _check(candidates: Mapping[Any, str], references: Mapping[Any, Sequence[str]]) -> None:
    missing = [k for k in candidates if k not in references]
    if missing:
        raise UserError(f"generation metrics: {len(missing)} predictions have no reference (first id "
                        f"{missing[0]!r}); score predictions of the split the references come from.")
