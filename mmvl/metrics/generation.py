"""Scores of generated text: caption metrics and VQA accuracy of generated answers.

The functions take what ``mmvl_predict`` writes for a generative model: candidates ``{id: text}``
and references ``{id: [texts]}``. The registered metrics ``cider``, ``bleu4``, ``rouge_l`` and
``generated_vqa_accuracy`` score the same during evaluation: the evaluation decodes the split with
the model's ``generate`` (their :attr:`GeneratedText.generates` asks for it) and hands them the
decoded text as ``output["generated"]``, beside each sample's reference (``batch["answer"]``: one
string, or a list of strings for several references). They keep one text and its references per
sample, gathered over the ranks in dataset order, and score the whole split at the end: CIDEr's
document frequencies are the split's, so it cannot be summed batch by batch. Caption metrics (BLEU-4, CIDEr, ROUGE-L) are pycocoevalcap's own
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
from mmvl.metrics.base import Metric
from mmvl.registry import register_metric

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


class GeneratedText(Metric):
    """Base of the metrics of generated text: per sample, the decoded text and its references."""

    #: the evaluation decodes the split for this metric (``output["generated"]``: one text a sample)
    generates = True
    required_keys = ("answer",)
    output_keys = ("generated",)

    def result_names(self) -> tuple[str, ...]:
        """What :meth:`compute` returns, known before any evaluation (``early_stop.criteria`` is checked against it)."""
        return (self.name,)

    def update(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> None:
        self.check(batch, output)
        texts = [str(t) for t in output["generated"]]
        refs = [[str(r) for r in ref] if isinstance(ref, (list, tuple)) else [str(ref)] for ref in batch["answer"]]
        self.add("candidates", "cat", texts)
        self.add("references", "cat", refs)

    def texts(self) -> tuple[dict[int, str], dict[int, list[str]]]:
        """Candidates and references by dataset position."""
        self.require_samples()
        candidates, references = self.state("candidates", []), self.state("references", [])
        return dict(enumerate(candidates)), dict(enumerate(references))

    def check(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> int:
        if "generated" not in output:
            raise UserError(f"metric {self.name!r} scores generated text and the model wrote none; list it for a "
                            "generative model (model: vlm) only.")
        return super().check(batch, {"generated": output["generated"]})


class CaptionScore(GeneratedText):
    """One of :func:`caption_scores`' corpus-level scores (its ``name``), higher is better."""

    def compute(self) -> dict[str, float]:
        return {self.name: caption_scores(*self.texts())[self.name]}


@register_metric("cider")
class Cider(CaptionScore):
    """CIDEr (pycocoevalcap's, on word tokens) of the decoded split against its references."""

    name = "cider"


@register_metric("bleu4")
class Bleu4(CaptionScore):
    """Corpus BLEU-4 (pycocoevalcap's) of the decoded split against its references."""

    name = "bleu4"


@register_metric("rouge_l")
class RougeL(CaptionScore):
    """ROUGE-L (pycocoevalcap's) of the decoded split against its references."""

    name = "rouge_l"


@register_metric("generated_vqa_accuracy")
class GeneratedVQAAccuracy(GeneratedText):
    """VQA accuracy of generated answers (:func:`vqa_accuracy`: the official normalisation). With
    ``group_key`` (a batch field: an index into ``group_names``) also ``generated_vqa_accuracy/<group>``
    for every group with samples, e.g. per question type."""

    name = "generated_vqa_accuracy"

    def __init__(self, group_key: str | None = None, group_names: Sequence[str] | None = None):
        self.group_key = group_key
        self.group_names = [str(g) for g in group_names] if group_names is not None else None
        self.required_keys = ("answer",) + ((group_key,) if group_key else ())

    def result_names(self) -> tuple[str, ...] | None:
        if self.group_key and self.group_names is None:
            return None  # the groups are known only once seen
        return (self.name, *(f"{self.name}/{g}" for g in self.group_names or []))

    def update(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> None:
        super().update(batch, output)
        if self.group_key:
            raw = batch[self.group_key]
            values = raw.tolist() if hasattr(raw, "tolist") else list(raw)
            names = self.group_names
            groups = [str(v) if names is None or isinstance(v, str) else names[int(v)] if 0 <= int(v) < len(names)
                      else str(v) for v in values]
            self.add("groups", "cat", groups)

    def compute(self) -> dict[str, float]:
        candidates, references = self.texts()
        result = {self.name: vqa_accuracy(candidates, references)}
        if self.group_key:
            groups = self.state("groups", [])
            order = self.group_names if self.group_names is not None else sorted(set(groups))
            for name in order:
                keys = [i for i, g in enumerate(groups) if g == name]
                if keys:
                    result[f"{self.name}/{name}"] = vqa_accuracy({k: candidates[k] for k in keys}, references)
        return result
