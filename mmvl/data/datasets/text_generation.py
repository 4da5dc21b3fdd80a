"""What a dataset builder whose targets are generated text shares: the model's vocabulary from its
text processor, and prediction rows that carry their reference, so a predictions file scores itself
(:mod:`mmvl.metrics.generation`) without the dataset."""
from __future__ import annotations

from typing import Any

from mmvl.errors import UserError


class GeneratesText:
    """Mixed into a builder with a ``text_processor`` (``prompt_answer``) and samples with an ``answer``."""

    @property
    def text_processor(self) -> Any:
        """The builder's ``prompt_answer`` processor (no other writes labelled answer tokens)."""
        kind = ((self.cfg.get("processors") or {}).get("text_processor") or {}).get("type")  # type: ignore[attr-defined]
        if kind != "prompt_answer":
            name = self.name  # type: ignore[attr-defined]
            raise UserError(f"dataset_config.{name}.processors.text_processor.type={kind!r}; {name} needs prompt_answer.")
        return super().text_processor  # type: ignore[misc]  # the builder's processor cache

    def collate(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        """The base builder's batch, its padding positions holding the tokenizer's pad id."""
        batch = super().collate(items)  # type: ignore[misc]  # the builder this is mixed into
        pad = self.text_processor.tokenizer.pad_token_id
        batch["input_ids"] = batch["input_ids"].masked_fill(batch["attention_mask"].eq(0), pad)
        return batch

    def model_info(self) -> dict[str, int]:
        return self.text_processor.model_info()

    def generated_text(self, ids: Any) -> list[str]:
        """Generated token ids (``B x new``, from the model's ``generate``) -> one text a sample, as
        the generation metrics and the predictions file read it."""
        return [self.text_processor.decode(row) for row in ids.tolist()]

    def predictions(self, data: dict[str, Any], scores: Any) -> list[dict[str, Any]]:
        """``[{"id", "answer", "reference"}]``: the decoded generated text (``scores`` are generated ids)
        and the true answer or caption."""
        ids = data.get("id", [])
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return [{"id": i, "answer": text, "reference": ref}
                for i, text, ref in zip(ids, self.generated_text(scores), data["answer"])]

    def extra_metrics(self, split: str) -> dict[str, float]:
        """None: generated text is scored from the predictions file (BLEU-4, CIDEr, ROUGE-L)."""
        return {}
