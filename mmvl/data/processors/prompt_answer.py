"""``prompt_answer``: one sample of a generative VLM as token ids, with only the answer labelled.

The layout is ``[bos] <image> x image_tokens  prompt  answer [eos]``; ``targets`` is -100 (ignored)
everywhere but at the answer and its end token, so the loss counts answer tokens only. A sample
longer than ``max_length`` has its text cut (``on_too_long: cut_text``: the answer's tail first,
then the prompt's) or is refused (``error``); its image tokens are never cut: a model whose
placeholders do not match its image tokens would silently misread every later token.

Tokens come from a transformers tokenizer in a local folder (``tokenizer_path``: the LM's folder)
or, for LMs trained from scratch, from a word vocabulary of the training texts (``vocab``'s
words plus ``<image>``).
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from mmvl.errors import UserError, library_input
from mmvl.losses import IGNORE_INDEX
from mmvl.registry import register_processor
from mmvl.data.processors.vocab import SPECIAL_TOKENS, VocabProcessor

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

        with library_input(f"prompt_answer: tokenizer_path={str(path)!r} does not load",
                           "give a folder written by a tokenizer's save_pretrained."):
            self.tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
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
        if tokenizer_path:
            self.tokenizer: Any = _HF(str(tokenizer_path), image_token)
        elif texts is not None:
            self.tokenizer = _Words(texts, image_token)
        else:
            raise UserError("prompt_answer: give tokenizer_path (the LM's folder) or a dataset that passes its "
                            "training texts (a word vocabulary for an LM trained from scratch).")
        fixed = self.image_tokens + (self.tokenizer.bos_token_id is not None)
        if fixed + 1 > self.max_length:
            raise UserError(f"prompt_answer: max_length={self.max_length} leaves no room for text after "
                            f"{self.image_tokens} image tokens; raise max_length (image tokens are never cut).")

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def model_info(self) -> dict[str, int]:
        """The ids a VLM needs from its tokenizer (filled into ``model_config.vlm``'s null keys)."""
        t = self.tokenizer
        return {"vocab_size": len(t), "image_token_id": t.image_id, "pad_token_id": t.pad_token_id,
                "eos_token_id": t.eos_token_id}

    def decode(self, ids: list[int]) -> str:
        """Generated ids -> text (stopping at the end token)."""
        eos = self.tokenizer.eos_token_id
        ids = list(ids)
        return self.tokenizer.decode(ids[: ids.index(eos)] if eos in ids else ids)

    def __call__(self, prompt: str, answer: str | None = None) -> dict[str, torch.Tensor]:
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
