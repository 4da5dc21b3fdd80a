"""Conversations as token ids with only the assistant turns labelled: through the tokenizer's own
chat template where its folder has one, else mmvl's plain layout.

Template: the conversation is rendered by ``tokenizer.apply_chat_template`` (transformers runs the
Jinja template in its sandbox; mmvl never renders one itself). Which characters are an assistant
turn is found without markers in the template: the conversation is rendered up to each assistant
turn with the generation prompt, and up to the end of that turn; the turn's content lies between
the two. That holds only where earlier turns render the same whatever follows, which is checked
(a template that re-renders earlier turns is refused). The text is then tokenised piece by piece,
cut at the content's edges, so a label never straddles a prompt token. Each labelled turn covers
its content and the template's end-of-turn token (the first token after the content: ``<|im_end|>``
in ChatML, ``<|eot_id|>`` in Llama 3), which is also what generation stops at (:attr:`end_id`).

Plain (no template): ``[bos] <image> x N  user  assistant [eos]  user  assistant [eos] ...``: a
single turn is exactly the ``prompt_answer`` layout.

Either way the one ``<image>`` placeholder of a conversation with an image becomes the model's
``image_tokens`` placeholders, at the start of the turn that holds it (as LLaVA moves it there).
"""
from __future__ import annotations

from typing import Any, Sequence

from mmvl.errors import UserError, library_input

#: what a rendered probe conversation's assistant turn says (found again to locate the end-of-turn token)
_PROBE = "mmvl probe answer"
ROLES = ("user", "assistant")


def check_turns(turns: Sequence[dict[str, str]], images: int | bool, image_token: str, where: str) -> None:
    """A conversation mmvl can train on: user first, then assistant and user in turn, ending with the
    assistant; as many ``image_token`` placeholders in its user turns as it has ``images`` (a bool:
    one or none)."""
    if not turns:
        raise UserError(f"{where}: the conversation has no turns; give user/assistant turns.")
    for i, turn in enumerate(turns):
        if turn.get("role") != ROLES[i % 2]:
            said = "the first turn is not the user's (LLaVA: human)" if i == 0 else \
                f"turn {i} is the {turn.get('role')}'s after the {turns[i - 1].get('role')}'s"
            raise UserError(f"{where}: {said}; turns alternate human/gpt (user/assistant), human first.")
    if turns[-1]["role"] != "assistant":
        raise UserError(f"{where}: the conversation ends with a user turn; end it with the assistant's (gpt) answer.")
    answered = next((i for i, t in enumerate(turns) if t["role"] == "assistant" and image_token in str(t["content"])),
                    None)
    if answered is not None:  # it would land in the labelled answer as text the model learns to write
        raise UserError(f"{where}: turn {answered} (the assistant's, gpt) holds {image_token}; put the placeholder in "
                        "the first human turn.")
    placeholders = sum(str(t["content"]).count(image_token) for t in turns)
    count = int(images)
    if count and placeholders != count:
        said = "an image" if count == 1 else f"{count} images"
        raise UserError(f"{where}: it has {said} and {placeholders} {image_token} placeholders; put one "
                        f"{image_token} per image in the human turns (in the images' order).")
    if not count and placeholders:
        raise UserError(f"{where}: {image_token} appears, but the sample has no image; drop the placeholder or "
                        "give the sample an image.")


def labelled_turns(turns: Sequence[dict[str, str]], label: str) -> list[bool]:
    """Which turns are labelled: every assistant turn (``label: all``, training) or only the last turn
    (``last``: the one evaluation generates and scores)."""
    last = len(turns) - 1
    return [t["role"] == "assistant" and (label == "all" or k == last) for k, t in enumerate(turns)]


def image_first(turns: Sequence[dict[str, str]], image_token: str) -> list[dict[str, str]]:
    """The turns with their image placeholders moved to the start of the turn that holds them (in
    their order: one for each image)."""
    out = []
    for turn in turns:
        content = str(turn["content"])
        if image_token in content:
            content = f"{image_token}\n" * content.count(image_token) + content.replace(image_token, "").strip()
        out.append({"role": turn["role"], "content": content})
    return out


def structured(turns: Sequence[dict[str, str]], image_token: str) -> list[dict[str, Any]]:
    """Turns as a processor's chat template reads them: each content a list of ``{"type": "image"}``
    and ``{"type": "text", "text"}`` items, an image item at each ``image_token`` of the text."""
    out = []
    for turn in turns:
        items: list[dict[str, str]] = []
        for k, text in enumerate(str(turn["content"]).split(image_token)):
            if k:
                items.append({"type": "image"})
            if text.strip():
                items.append({"type": "text", "text": text.strip()})
        out.append({"role": turn["role"], "content": items})
    return out


class ChatTemplate:
    """A chat template as a conversation layout (see the module docstring). ``renderer`` holds the
    template (a tokenizer, or a VLM's processor: then ``image_token`` is set and turns render as
    structured content, an image item at each placeholder); ``tokenizer`` encodes (the renderer by
    default)."""

    def __init__(self, renderer: Any, where: str, tokenizer: Any = None, image_token: str | None = None):
        self.renderer, self.where, self.image_token = renderer, where, image_token
        self.tok = renderer if tokenizer is None else tokenizer
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
        start, end = self.render(probe[:1], True), self.render(probe)
        at = end.find(_PROBE, len(start)) if end.startswith(start) else -1
        if at < 0:
            raise UserError(f"{where}: the tokenizer's chat_template renders no assistant turn (a user turn and an "
                            "assistant turn render without the assistant's text after the generation prompt); "
                            "fix the template or remove chat_template from the folder.")
        tail = self.encode(end[at + len(_PROBE):])
        #: the template's end-of-turn token, labelled after each assistant turn; generation stops at it
        self.end_id = int(tail[0]) if tail else int(self.tok.eos_token_id)

    def render(self, turns: Sequence[dict[str, str]], generation_prompt: bool = False) -> str:
        messages = structured(turns, self.image_token) if self.image_token else list(turns)
        with library_input(f"{self.where}: the chat_template does not render", "fix the template."):
            return str(self.renderer.apply_chat_template(messages, tokenize=False,
                                                         add_generation_prompt=generation_prompt))

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"]) if text else []

    def tokens(self, turns: Sequence[dict[str, str]], labelled: Sequence[bool],
               generation_prompt: bool = False) -> tuple[list[int], list[bool]]:
        """Token ids of the rendered conversation and, per token, whether it is labelled (the content
        of each assistant turn ``labelled`` marks, and its end-of-turn token). ``generation_prompt``:
        the turns end with a user turn, rendered up to the assistant's generation prompt."""
        full = self.render(turns, generation_prompt)
        pieces: list[tuple[str, str]] = []  # (text, "prompt" | "content" | "after")
        pos = 0
        for k, turn in enumerate(turns):
            if turn["role"] != "assistant":
                continue
            start, end = self.render(turns[:k], True), self.render(turns[: k + 1])
            if not (end.startswith(start) and full.startswith(end)):
                raise UserError(f"{self.where}: the chat_template renders earlier turns differently once later ones "
                                "follow, so the assistant turns cannot be told apart; use a template without that.")
            content = str(turn["content"]).strip()
            at = end.find(content, len(start)) if content else len(start)
            if at < 0:
                raise UserError(f"{self.where}: the chat_template renders no assistant turn for turn {k} (its text "
                                "does not appear after the generation prompt); fix the template.")
            pieces += [(full[pos:at], "prompt"), (full[at: at + len(content)], "content" if labelled[k] else "prompt")]
            pieces.append(("", "after" if labelled[k] else "prompt"))  # marks: the next token is the turn's end
            pos = at + len(content)
        pieces.append((full[pos:], "prompt"))
        ids: list[int] = []
        mask: list[bool] = []
        end_next = False
        for text, kind in pieces:
            if kind == "after":
                end_next = True
                continue
            piece = self.encode(text)
            ids += piece
            mask += [kind == "content"] * len(piece)
            if end_next and piece:
                mask[len(mask) - len(piece)] = piece[0] == self.end_id
                end_next = False
        return ids, mask
