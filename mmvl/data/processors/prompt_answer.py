"""``prompt_answer``: one sample of a generative VLM as token ids, with only the answer labelled.

The layout is ``[bos] <image> x image_tokens  prompt  answer [eos]``; ``targets`` is -100 (ignored)
everywhere but at the answer and its end token, so the loss counts answer tokens only. A
conversation of several turns (:meth:`PromptAnswerProcessor.conversation`) labels each assistant
turn the same way. Where the tokenizer's folder has a ``chat_template``, every sample (a prompt and
its answer, or a conversation) is rendered through it instead, and its end-of-turn token is the end
token (:mod:`mmvl.data.processors.chat`). A sample
longer than ``max_length`` has its text cut (``on_too_long: cut_text``: the answer's tail first,
then the prompt's) or is refused (``error``); its image tokens are never cut: a model whose
placeholders do not match its image tokens would silently misread every later token.

Tokens come from a transformers tokenizer in a local folder (``tokenizer_path``: the LM's folder)
or, for LMs trained from scratch, from a word vocabulary of the training texts (``vocab``'s
words plus ``<image>``).
"""
from __future__ import annotations

import os
from typing import Any, Iterable

import torch

from mmvl.data.processors.chat import ChatTemplate, check_turns, image_first, labelled_turns
from mmvl.data.processors.vocab import SPECIAL_TOKENS, VocabProcessor
from mmvl.errors import UserError, library_input
from mmvl.labels import IGNORE_INDEX
from mmvl.registry import register_processor

#: the placeholder the model replaces by image tokens
IMAGE_TOKEN = "<image>"
POLICIES = ("cut_text", "error")


class _Words:
    """A word vocabulary of the training texts as a minimal tokenizer (bos ``[CLS]``, eos ``[SEP]``)."""

    def __init__(self, texts: Iterable[str], image_token: str):
        vocab = VocabProcessor(texts=texts, max_seq_length=10**6)
        self.itos = vocab.itos + [image_token]
        self.vocab = vocab
        self.pad_token_id, self.bos_token_id, self.eos_token_id = vocab.pad_id, vocab.cls_id, vocab.sep_id
        self.image_id = len(self.itos) - 1

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        return self.vocab.encode(text)[1:-1]  # without [CLS]/[SEP]

    def decode(self, ids: list[int]) -> str:
        specials = {self.pad_token_id, self.bos_token_id, self.eos_token_id, self.image_id}
        return " ".join(self.itos[i] for i in ids if 0 <= i < len(self.itos) and i not in specials)


class _HF:
    """A transformers tokenizer from a local folder, with the image placeholder looked up in it."""

    def __init__(self, path: str, image_token: str):
        from transformers import AutoTokenizer

        if not os.path.isdir(os.path.expanduser(str(path))):
            raise UserError(f"prompt_answer: tokenizer_path={str(path)!r} is not a folder; give the LM's local folder "
                            "(a tokenizer written by save_pretrained).")
        with library_input(f"prompt_answer: tokenizer_path={str(path)!r} does not load",
                           "give a folder written by a tokenizer's save_pretrained."):
            self.tok = AutoTokenizer.from_pretrained(os.path.expanduser(str(path)), local_files_only=True)
        found = self.tok.convert_tokens_to_ids(image_token)
        if found is None or (found == self.tok.unk_token_id and image_token != self.tok.unk_token):
            raise UserError(f"prompt_answer: the tokenizer in {path!r} has no token {image_token!r}; add it "
                            "(tokenizer.add_tokens + model.resize_token_embeddings, then save_pretrained).")
        self.image_id = int(found)
        self.bos_token_id, self.eos_token_id = self.tok.bos_token_id, self.tok.eos_token_id
        pad = self.tok.pad_token_id
        self.pad_token_id = pad if pad is not None else self.eos_token_id
        if self.eos_token_id is None:
            raise UserError(f"prompt_answer: the tokenizer in {path!r} has no eos token; set one and save it.")

    def __len__(self) -> int:
        return len(self.tok)

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True).strip()


@register_processor("prompt_answer")
class PromptAnswerProcessor:
    """``processor(prompt, answer=None)`` -> ``input_ids``, ``attention_mask``, ``targets`` (1-D long).

    ``answer=None`` gives the prompt alone (for generation). ``image_tokens`` must equal the number
    of tokens the model makes of one image (its encoder grid / ``pixel_shuffle``^2).
    """

    def __init__(self, image_tokens: int, tokenizer_path: str | None = None, texts: Iterable[str] | None = None,
                 max_length: int = 64, on_too_long: str = "cut_text", image_token: str = IMAGE_TOKEN):
        if on_too_long not in POLICIES:
            raise UserError(f"prompt_answer: on_too_long={on_too_long!r}; use one of {', '.join(POLICIES)}.")
        self.image_tokens, self.max_length, self.on_too_long = int(image_tokens), int(max_length), on_too_long
        self.image_token = image_token  # the placeholder in text
        if tokenizer_path:
            self.tokenizer: Any = _HF(str(tokenizer_path), image_token)
        elif texts is not None:
            self.tokenizer = _Words(texts, image_token)
        else:
            raise UserError("prompt_answer: give tokenizer_path (the LM's folder) or a dataset that passes its "
                            "training texts (a word vocabulary for an LM trained from scratch).")
        template = getattr(getattr(self.tokenizer, "tok", None), "chat_template", None)
        self.chat = ChatTemplate(self.tokenizer.tok, f"prompt_answer: tokenizer_path={str(tokenizer_path)!r}") \
            if template else None
        fixed = self.image_tokens + (self.tokenizer.bos_token_id is not None)
        if fixed + 1 > self.max_length:
            raise UserError(f"prompt_answer: max_length={self.max_length} leaves no room for text after "
                            f"{self.image_tokens} image tokens; raise max_length (image tokens are never cut).")

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def model_info(self) -> dict[str, int]:
        """The ids a VLM needs from its tokenizer, and how many image placeholders it writes (filled into
        ``model_config.vlm``'s null keys)."""
        t = self.tokenizer
        return {"vocab_size": len(t), "image_token_id": t.image_id, "pad_token_id": t.pad_token_id,
                "eos_token_id": self.end_id, "image_tokens": self.image_tokens}

    @property
    def end_id(self) -> int:
        """The token that ends an answer (labelled after it; generation stops at it): the chat
        template's end-of-turn token, else the tokenizer's eos."""
        return self.chat.end_id if self.chat is not None else int(self.tokenizer.eos_token_id)

    def length(self, texts: Iterable[str], has_image: bool | int) -> int:
        """About how many tokens a sample of these prompt and answer ``texts`` takes: its words, one
        end token a text, the image tokens, held to ``max_length``. What ``training.group_by_length``
        sorts by (only the order of lengths matters there, so no tokenizer runs)."""
        words = sum(len(str(text).split()) + 1 for text in texts)
        return min(self.max_length, words + self.image_tokens * int(has_image) + 1)

    def decode(self, ids: list[int]) -> str:
        """Generated ids -> text (stopping at the end token)."""
        ids = list(ids)
        return self.tokenizer.decode(ids[: ids.index(self.end_id)] if self.end_id in ids else ids)

    def conversation(self, turns: list[dict[str, str]], has_image: bool | int, label: str = "all",
                     where: str = "prompt_answer") -> dict[str, torch.Tensor]:
        """``turns`` (``{"role": "user" | "assistant", "content"}``, user first, alternating, ending with
        the assistant; one ``<image>`` in the user turns per image: ``has_image`` is how many, a bool
        one or none) as ``input_ids``, ``attention_mask`` and ``targets``: every assistant turn labelled
        (``label: all``, training) or only the last (``label: last``: what evaluation generates and
        scores). ``where`` names the sample in errors."""
        placeholder = self.image_token
        check_turns(turns, has_image, placeholder, where)
        turns = image_first(turns, placeholder)
        labelled = labelled_turns(turns, label)
        if self.chat is not None:
            ids, mask = self.chat.tokens(turns, labelled)
            ids, mask = self._expand_image(ids, mask, has_image, where)
        else:
            ids, mask = self._plain(turns, labelled, has_image, placeholder)
        return self._sample(ids, mask, where)

    def _plain(self, turns: list[dict[str, str]], labelled: list[bool], has_image: bool | int,
               placeholder: str) -> tuple[list[int], list[bool]]:
        """``[bos] <image> x N  user  assistant [eos] ...``: the single-turn layout, turn after turn."""
        t = self.tokenizer
        head = [t.bos_token_id] if t.bos_token_id is not None else []
        ids = head + [t.image_id] * (self.image_tokens * int(has_image))
        mask = [False] * len(ids)
        for turn, label in zip(turns, labelled):
            piece = t.encode(str(turn["content"]).replace(placeholder, "").strip())
            if turn["role"] == "assistant":
                piece = piece + [t.eos_token_id]
            ids += piece
            mask += [label] * len(piece)
        return ids, mask

    def _expand_image(self, ids: list[int], mask: list[bool], has_image: bool | int,
                      where: str) -> tuple[list[int], list[bool]]:
        """Each rendered placeholder -> ``image_tokens`` of them."""
        image = self.tokenizer.image_id
        found = [i for i, v in enumerate(ids) if v == image]
        if len(found) != int(has_image):
            raise UserError(f"{where}: the chat template's rendering holds {len(found)} image placeholders, "
                            f"expected {int(has_image)}; the template must keep message text as given.")
        for at in reversed(found):
            ids = ids[:at] + [image] * self.image_tokens + ids[at + 1:]
            mask = mask[:at] + [False] * self.image_tokens + mask[at + 1:]
        return ids, mask

    def _sample(self, ids: list[int], mask: list[bool], where: str) -> dict[str, torch.Tensor]:
        """The sample's tensors, held to ``max_length`` by ``on_too_long`` (the end is cut; the image
        tokens, which come first, never are)."""
        if len(ids) > self.max_length:
            if self.on_too_long == "error":
                raise UserError(f"{where}: {len(ids)} tokens with the image tokens exceed max_length="
                                f"{self.max_length}; raise max_length or set on_too_long: cut_text.")
            image = self.tokenizer.image_id
            if image in ids[self.max_length:]:
                raise UserError(f"{where}: its image tokens end after max_length={self.max_length}; raise "
                                "max_length (image tokens are never cut).")
            ids, mask = ids[: self.max_length], mask[: self.max_length]
        tensor = torch.tensor(ids, dtype=torch.long)
        targets = torch.where(torch.tensor(mask, dtype=torch.bool), tensor, torch.full_like(tensor, IGNORE_INDEX))
        return {"input_ids": tensor, "attention_mask": torch.ones_like(tensor), "targets": targets}

    def __call__(self, prompt: str, answer: str | None = None) -> dict[str, torch.Tensor]:
        if self.chat is not None:  # the template's layout: one user turn with the image, the answer
            user = [{"role": "user", "content": f"{self.image_token}\n{prompt}"}]
            if answer is None:
                ids, mask = self.chat.tokens(user, [False], generation_prompt=True)
                return self._sample(*self._expand_image(ids, mask, True, "prompt_answer"), "prompt_answer")
            return self.conversation(user + [{"role": "assistant", "content": answer}], True)
        t = self.tokenizer
        head = ([t.bos_token_id] if t.bos_token_id is not None else []) + [t.image_id] * self.image_tokens
        question = t.encode(prompt)
        reply = [] if answer is None else t.encode(answer) + [t.eos_token_id]
        room = self.max_length - len(head)
        if len(question) + len(reply) > room:
            if self.on_too_long == "error":
                raise UserError(f"prompt_answer: a sample of {len(head) + len(question) + len(reply)} tokens "
                                f"exceeds max_length={self.max_length} (image tokens are never cut); raise "
                                "max_length or set on_too_long: cut_text.")
            question = question[:room]
            reply = reply[: room - len(question)]
        ids = torch.tensor(head + question + reply, dtype=torch.long)
        targets = torch.full_like(ids, IGNORE_INDEX)
        if reply:
            targets[len(ids) - len(reply):] = torch.tensor(reply, dtype=torch.long)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "targets": targets}


__all__ = ["IMAGE_TOKEN", "PromptAnswerProcessor", "SPECIAL_TOKENS"]
