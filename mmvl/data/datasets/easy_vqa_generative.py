"""easy-VQA as generation (``datasets: [easy_vqa_generative]``): a VLM writes the answer, or a caption.

The same files, splits and images as ``easy_vqa`` (its builder reads them); an item is the image,
a prompt and the text to generate, as ``prompt_answer`` tokens (only the answer is labelled):

- ``task: vqa``: every question is a prompt, its answer word the text;
- ``task: conversation``: ``train`` holds one sample per image, its questions as the user turns of
  one conversation and their answers as the assistant turns (LLaVA's instruction data has this
  shape; one image encoding serves every answer), in an order drawn anew each epoch;
  ``val``/``test`` ask each question alone, as ``task: vqa`` does. A history of earlier questions
  would give answers away (easy-VQA's questions name the shape or colour they ask about), so each
  scored answer is read off the image;
- ``task: caption``: one sample per image, the prompt ``caption_prompt`` and the caption
  ``the image shows a <colour> <shape>`` (each image holds one shape of one colour; six words, so
  that BLEU-4 has 4-grams to count). easy-VQA has no captions: the
  colour and the shape are read off the image's questions and answers (``what color is the
  shape?`` -> red; ``is there not a circle?`` -> no: a circle). An image whose questions leave the
  colour or the shape open (about one in ten) has no caption and is left out.

Unlike Sort-of-CLEVR's relational questions, most answers here (the colour, the shape) are read
directly off the pixels, so a projector that carries the image shows in what the model writes.
Every split keeps its answers: ``mmvl_predict`` writes ``[{"id", "answer", "reference"}]``
(:mod:`mmvl.metrics.generation` scores them).
"""
from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Iterable

import numpy as np
from torch.utils.data import Dataset

from mmvl.data.datasets.easy_vqa import EasyVQABuilder, EasyVQADataset, question_words
from mmvl.data.processors import prompt_answer as _prompt_answer  # noqa: F401  (registers prompt_answer)
from mmvl.data.records import Strings, Table
from mmvl.data.datasets.text_generation import GeneratesText, visual_sample
from mmvl.errors import UserError
from mmvl.registry import register_dataset

#: easy-VQA's shapes and colours (its answers besides yes and no)
SHAPES = ("circle", "rectangle", "triangle")
COLOURS = ("red", "green", "blue", "black", "gray", "teal", "brown", "yellow")
TASKS = ("vqa", "caption", "conversation")
#: ``conversation_order``'s values: every turn in the epoch's order | yes/no turns first, then the open ones
ORDERS = ("shuffled", "closed_first")
#: ``colour_questions``' values: the training conversations' yes/no colour turns as easy-VQA asks them |
#: some asked about the image's own colour instead, so that each epoch holds as many of those as of the others
COLOUR_QUESTIONS = ("as_asked", "balanced")
#: easy-VQA's ``type`` of a yes/no question (``TYPE_NAMES[0]``)
YES_NO = 0
#: ``question_type`` of a caption sample (easy-VQA's question types are 0-2)
CAPTION_TYPE = 3
CAPTION = "the image shows a {colour} {shape}"


def _the_one(named: set[str], ruled_out: set[str], choices: tuple[str, ...]) -> str | None:
    """The one choice the questions name, else the one they do not rule out, else None."""
    if len(named) == 1:
        return next(iter(named))
    left = [c for c in choices if c not in ruled_out]
    return left[0] if not named and len(left) == 1 else None


def image_contents(questions: Iterable[str], answers: Iterable[str],
                   image_ids: Iterable[int]) -> dict[int, tuple[str | None, str | None]]:
    """``{image_id: (colour, shape)}``, each None where the image's questions and answers leave it open."""
    named: dict[int, set[str]] = defaultdict(set)
    ruled_out: dict[int, set[str]] = defaultdict(set)
    for question, answer, image in zip(questions, answers, image_ids):
        words = question_words(question)
        if words and words[0] in ("is", "does", "are", "do"):  # yes/no: is (not) the named thing there?
            negated = "not" in words or "no" in words
            target = named if (answer == "yes") != negated else ruled_out
        else:  # what colour / what shape: the question and its answer name what is there
            words, target = words + [answer], named
        target[int(image)].update(w for w in words if w in SHAPES or w in COLOURS)
    return {image: (_the_one(named[image] & set(COLOURS), ruled_out[image], COLOURS),
                    _the_one(named[image] & set(SHAPES), ruled_out[image], SHAPES))
            for image in sorted(set(named) | set(ruled_out))}


def image_captions(questions: Iterable[str], answers: Iterable[str], image_ids: Iterable[int]) -> dict[int, str]:
    """``{image_id: "the image shows a <colour> <shape>"}`` for the images whose questions and answers fix both."""
    return {image: CAPTION.format(colour=colour, shape=shape)
            for image, (colour, shape) in image_contents(questions, answers, image_ids).items() if colour and shape}


class GenerativeEasyVQA(EasyVQADataset):
    """Items: ``image``, ``input_ids``, ``attention_mask``, ``targets`` (token labels), ``answer`` (text), ids."""

    def __init__(self, records: Table, pixels: Any, image_rows: np.ndarray, text_processor: Any, image_processor: Any):
        super().__init__(records, pixels, image_rows, np.zeros(0, np.int64), text_processor, image_processor)
        self.answers = records.column("answer")

    def __getitem__(self, index: int) -> dict[str, Any]:
        answer = self.answers[index]
        item: dict[str, Any] = {"id": int(self.ids[index]), "image_id": int(self.image_ids[index])}
        item.update(visual_sample(self.text_processor, self.pixel_maker, [self.pixels[int(self.image_rows[index])]],
                                  prompt=self.questions[index], answer=answer, where=f"easy_vqa row {index}"))
        item.update(answer=answer, question_type=int(self.types[index]))
        return item

    def sample_lengths(self) -> list[int]:
        """About each sample's tokens (``training.group_by_length``)."""
        return [self.text_processor.length(pair, True) for pair in zip(self.questions, self.answers)]

    def pixel_maker(self, image: Any) -> Any:
        """The image processor's pixels of an easy-VQA image (uint8 C x H x W), or them scaled to [0, 1]."""
        return self.image_processor(image) if self.image_processor is not None else image.float() / 255.0


class ConversationEasyVQA(GenerativeEasyVQA):
    """``task: conversation``'s training items: one per image, its questions and answers as turns
    (every answer labelled), their order a permutation seeded by the item and the epoch.

    ``closed_first``: the yes/no turns come first (each group still in the epoch's order). An open
    turn earlier in a conversation names the colour or shape (``what color is the shape?`` -> red,
    ``what is the red shape?``), so a later ``is there a red shape?`` can be answered by matching
    words in the history instead of the image; in easy-VQA's training set two thirds of the yes/no
    questions about the image's colour have it named earlier when all turns are shuffled, a quarter
    when the yes/no turns come first. Val and test ask each question alone, from the image.

    ``balanced_colours`` (``colour_questions: balanced``): easy-VQA's yes/no colour questions name a
    colour the image lacks far more often than its own, so "no" scores well without the pixels; each
    such turn is, by a chance drawn per epoch, asked about the image's own colour instead."""

    def __init__(self, records: Table, pixels: Any, image_rows: np.ndarray, text_processor: Any,
                 image_processor: Any, sampled: bool = False, closed_first: bool = False,
                 balanced_colours: bool = False):
        super().__init__(records, pixels, image_rows, text_processor, image_processor)
        self.sampled = sampled  # each epoch, the first k of the permuted turns, k drawn from 1..all
        self.closed_first = closed_first
        self.recoloured, self.recolour_chance = (self._recolourings() if balanced_colours else ({}, 0.0))
        order = np.lexsort((self.ids, self.image_ids))  # by image, then by question
        images = self.image_ids[order]
        starts = np.flatnonzero(np.r_[True, images[1:] != images[:-1]]) if len(images) else np.zeros(0, np.int64)
        self.turns = np.split(order, starts[1:]) if len(order) else []
        self.epoch = 0

    def _recolourings(self) -> tuple[dict[int, tuple[str, str]], float]:
        """``colour_questions: balanced``: each yes/no turn that names a colour the image does not hold,
        asked about the image's own colour instead (``is there a blue shape?`` -> no becomes ``is there a
        red shape?`` -> yes on a red image), and the chance of asking it so that each epoch holds as many
        turns about the image's colour as about other colours."""
        questions, answers = self.questions.tolist(), self.answers.tolist()
        contents = image_contents(questions, answers, self.image_ids.tolist())
        recoloured: dict[int, tuple[str, str]] = {}
        present = 0
        for row, (question, answer) in enumerate(zip(questions, answers)):
            named = [w for w in question_words(question) if w in COLOURS]
            colour = contents.get(int(self.image_ids[row]), (None, None))[0]
            if answer not in ("yes", "no") or len(named) != 1 or colour is None:
                continue
            if named[0] == colour:
                present += 1
            else:
                recoloured[row] = (re.sub(rf"\b{named[0]}\b", colour, question, flags=re.IGNORECASE),
                                   "no" if answer == "yes" else "yes")
        absent = len(recoloured)
        return recoloured, max(absent - present, 0) / (2 * absent) if absent else 0.0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def sample_lengths(self) -> list[int]:
        """About each conversation's tokens, all its turns (``training.group_by_length``): its length
        in every epoch, whatever the order of its turns (``conversation_turns: sampled`` cuts it short
        by a number drawn each epoch, which no fixed grouping follows)."""
        if self.sampled:
            raise UserError("training.group_by_length=true with easy_vqa_generative conversation_turns=sampled: "
                            "a conversation's length is drawn anew each epoch; set one of them to its default.")
        return [self.text_processor.length([text for r in rows.tolist() for text in (self.questions[r], self.answers[r])],
                                           True) for rows in self.turns]

    def __len__(self) -> int:
        return len(self.turns)

    def __getitem__(self, index: int) -> dict[str, Any]:
        rng = np.random.default_rng([index, self.epoch])
        rows = self.turns[index][rng.permutation(len(self.turns[index]))]
        if self.closed_first:  # a stable sort keeps each group's drawn order
            rows = rows[np.argsort(self.types[rows] != YES_NO, kind="stable")]
        if self.sampled:
            rows = rows[: int(rng.integers(1, len(rows) + 1))]
        recolour = rng.random(len(rows)) < self.recolour_chance if self.recoloured else np.zeros(len(rows), bool)
        turns = []
        for r, swap in zip(rows.tolist(), recolour.tolist()):
            question, answer = (self.recoloured[r] if swap and r in self.recoloured
                                else (self.questions[r], self.answers[r]))
            user = question if turns else f"<image> {question}"
            turns += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        first = int(rows[0])
        item: dict[str, Any] = {"id": int(self.image_ids[first]), "image_id": int(self.image_ids[first])}
        item.update(visual_sample(self.text_processor, self.pixel_maker, [self.pixels[int(self.image_rows[first])]],
                                  turns=turns, where=f"easy_vqa image {item['image_id']}"))
        item.update(answer=turns[-1]["content"], question_type=-1)  # several questions: no one type
        return item


@register_dataset("easy_vqa_generative")
class EasyVQAGenerativeBuilder(GeneratesText, EasyVQABuilder):
    """easy-VQA whose answers (or captions) are generated text (a VLM's task)."""

    name = "easy_vqa_generative"
    config_path = "datasets/easy_vqa_generative.yaml"

    def __init__(self, config: Any, data_dir: str):
        super().__init__(config, data_dir)
        self.task = str(self.cfg.get("task", "vqa"))
        if self.task not in TASKS:
            raise UserError(f"{self.name}: task={self.task!r}; use one of {', '.join(TASKS)}.")
        self.conversation_turns = str(self.cfg.get("conversation_turns") or "all")
        if self.conversation_turns not in ("all", "sampled"):
            raise UserError(f"{self.name}: conversation_turns={self.conversation_turns!r}; use all or sampled.")
        self.conversation_order = str(self.cfg.get("conversation_order") or "shuffled")
        if self.conversation_order not in ORDERS:
            raise UserError(f"{self.name}: conversation_order={self.conversation_order!r}; use one of {', '.join(ORDERS)}.")
        self.colour_questions = str(self.cfg.get("colour_questions") or "as_asked")
        if self.colour_questions not in COLOUR_QUESTIONS:
            raise UserError(f"{self.name}: colour_questions={self.colour_questions!r}; use one of "
                            f"{', '.join(COLOUR_QUESTIONS)}.")
        if self.colour_questions == "balanced" and self.task != "conversation":
            raise UserError(f"{self.name}: colour_questions=balanced recolours task: conversation's training turns, "
                            f"and task={self.task!r}; set task=conversation or colour_questions=as_asked.")
        self.caption_prompt = str(self.cfg.get("caption_prompt") or "")
        if self.task == "caption" and not self.caption_prompt.strip():
            raise UserError(f"{self.name}: caption_prompt is empty; give the prompt a caption follows "
                            "(e.g. 'describe the image').")

    def samples(self, split: str) -> Table:
        questions = self.split_questions(split)
        if self.task in ("vqa", "conversation"):  # a conversation's turns are its image's questions
            return questions
        captions = image_captions(questions.column("question").tolist(), questions.column("answer").tolist(),
                                  questions.column("image_id").tolist())
        ids = np.asarray(sorted(captions), dtype=np.int64)
        return Table({"question_id": ids, "image_id": ids, "type": np.full(len(ids), CAPTION_TYPE, np.int64),
                      "question": Strings.build([self.caption_prompt] * len(ids)),
                      "answer": Strings.build([captions[i] for i in ids.tolist()])})

    def train_texts(self) -> list[str]:
        """The word vocabulary's texts, the same for both tasks (a caption model can be asked questions)."""
        train = self.split_questions("train")
        return (train.column("question").tolist() + train.column("answer").tolist()
                + [self.caption_prompt, CAPTION.format(colour=" ".join(COLOURS), shape=" ".join(SHAPES))])

    def prepare_split(self, split: str) -> None:
        self.records(split)
        self.text_processor  # noqa: B018  (the word vocabulary, when there is no tokenizer_path)

    def make_dataset(self, split: str, records: Table) -> Dataset:
        records, pixels, rows = self.readable_images(split, records)
        if self.task == "conversation" and split == "train":
            return ConversationEasyVQA(records, pixels, rows, self.text_processor, self.image_processor,
                                       sampled=self.conversation_turns == "sampled",
                                       closed_first=self.conversation_order == "closed_first",
                                       balanced_colours=self.colour_questions == "balanced")
        return GenerativeEasyVQA(records, pixels, rows, self.text_processor, self.image_processor)
