"""Two-tower (contrastive) evaluation: zero-shot classification and image-text retrieval.

These metrics read no model ``scores``: the evaluation binds them to the (unwrapped) model
before the split (:meth:`TwoTowerMetric.bind`) and they call its encoders themselves, the
interface every contrastive model gives (``clip``):

- ``model.encode_image(images [B, 3, H, W]) -> [B, D]``, L2-normalised;
- ``model.encode_text(input_ids [B, L], attention_mask [B, L]) -> [B, D]``, L2-normalised.

Text goes through a text processor (the dataset's, or one given in the metric's params), so
class prompts are tokenised exactly as training captions are. Both keep per-rank state only:
counts (zero-shot) or this rank's embeddings (retrieval, ranked against every rank's gallery in
blocks by :func:`mmvl.metrics.retrieval.gallery_ranks`), never a samples x samples matrix.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from mmvl.config.components import build_component
from mmvl.data.sample import collate
from mmvl.distributed import comm
from mmvl.errors import UserError
from mmvl.metrics.base import Metric, labels_of, rate
from mmvl.metrics.retrieval import gallery_ranks
from mmvl.registry import PROCESSORS, register_metric


class TwoTowerMetric(Metric):
    """A metric that encodes images and texts with the model it is bound to (``uses_model``)."""

    #: the evaluation binds the model and runs no forward for this metric
    uses_model = True
    output_keys: tuple[str, ...] = ()

    def bind(self, model: torch.nn.Module, text_processor: Callable[[], Any]) -> None:
        """Use ``model``'s encoders for this split; ``text_processor()`` gives the dataset's text
        processor (called only when the metric needs one and none was configured)."""
        for name in ("encode_image", "encode_text"):
            if not callable(getattr(model, name, None)):
                raise UserError(f"metric {self.name!r} needs a two-tower model with encode_image() and "
                                f"encode_text() (e.g. model: clip); {type(model).__name__} has no {name}().")
        self.model = model

    def check(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> int:
        if not hasattr(self, "model"):
            raise UserError(f"metric {self.name!r} was not bound to a model; the evaluation binds it "
                            "(mmvl.trainers.evaluation), or call bind(model, processor) first.")
        return super().check(batch, output)

    def encode_texts(self, processor: Any, texts: Sequence[str], batch_size: int, device: Any) -> torch.Tensor:
        """``[len(texts), D]`` float embeddings of ``texts``, ``batch_size`` at a time."""
        out = []
        for start in range(0, len(texts), batch_size):
            tokens = collate([processor(t) for t in texts[start:start + batch_size]])
            out.append(self.model.encode_text(tokens["input_ids"].to(device),
                                              tokens["attention_mask"].to(device)).float())
        return torch.cat(out) if out else torch.empty(0)


def _device(model: torch.nn.Module) -> torch.device:
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def _lines(value: Any, what: str) -> list[str]:
    """A list of strings, or the lines of the text file a string names."""
    if isinstance(value, str):
        path = Path(value).expanduser()
        if not path.is_file():
            raise UserError(f"metric 'zero_shot': {what}={value!r} is neither a list nor a file; give a list or "
                            "the path of a text file with one entry a line.")
        return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [str(v) for v in (value or [])]


@register_metric("zero_shot")
class ZeroShotClassification(TwoTowerMetric):
    """Zero-shot top-k accuracy: each image's class is the class whose prompts its embedding matches best.

    ``classnames`` (a list, or a text file with one a line; ``targets`` index it) x ``templates``
    (each with one ``{}`` for the name) are encoded once per evaluation: class ``c``'s weight is
    the mean of its templates' normalised embeddings, renormalised. Each rank encodes its share
    of the classes (``c = rank, rank + W, ...``) and the shares are gathered, so the classifier is
    the same on every rank. ``text_processor``: a ``{type, params}`` processor, null for the
    dataset's. ``target_key``: the batch key holding the class indices (``targets``; e.g. ``label`` for
    ``image_text_shards`` with ``label_names``). Reports ``zero_shot_top{k}`` for each ``k``.
    """

    name = "zero_shot"

    def __init__(self, classnames: Any = (), templates: Sequence[str] = ("a photo of a {}.",),
                 k: Sequence[int] | int = (1, 5), image_key: str = "image", text_processor: Any = None,
                 text_batch_size: int = 256, target_key: str = "targets"):
        self.classnames = _lines(classnames, "classnames")
        self.templates = _lines(templates, "templates")
        if not self.classnames or not self.templates:
            raise UserError("metric 'zero_shot' needs classnames and templates (e.g. templates: ['a photo of a {}.']).")
        bad = [t for t in self.templates if t.count("{}") != 1]
        if bad:
            raise UserError(f"metric 'zero_shot': templates {bad} must each hold exactly one '{{}}' for the class name.")
        self.ks = [int(x) for x in ([k] if isinstance(k, int) else k)]
        if not self.ks or min(self.ks) < 1:
            raise UserError(f"metric 'zero_shot': k must be positive integers, got {k!r}.")
        self.required_keys = (image_key, str(target_key))
        self.target_key = str(target_key)
        self.image_key, self.processor_config = image_key, text_processor
        self.text_batch_size = max(1, int(text_batch_size))

    def bind(self, model: torch.nn.Module, text_processor: Callable[[], Any]) -> None:
        super().bind(model, text_processor)
        processor = text_processor() if self.processor_config is None else \
            build_component(PROCESSORS, self.processor_config, where="zero_shot.text_processor")
        self.classifier = self.build_classifier(processor)

    @torch.no_grad()
    def build_classifier(self, processor: Any) -> torch.Tensor:
        """``[C, D]``: per class, the renormalised mean of its templates' normalised embeddings."""
        rank, world, device = comm.get_rank(), comm.get_world_size(), _device(self.model)
        mine = self.classnames[rank::world]
        texts = [t.replace("{}", c) for c in mine for t in self.templates]
        weights = self.encode_texts(processor, texts, self.text_batch_size, device)
        if len(mine):
            weights = torch.nn.functional.normalize(weights, dim=-1).reshape(len(mine), len(self.templates), -1)
            weights = torch.nn.functional.normalize(weights.mean(1), dim=-1)
        dim = comm.all_gather_object(int(weights.shape[-1]) if len(mine) else -1)
        weights = weights if len(mine) else torch.empty((0, max(dim)), device=device)
        return comm.gather_for_metrics(weights, len(self.classnames))  # class c is rank c % W's (c // W)-th

    def update(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> None:
        self.check(batch, output)
        labels = labels_of(batch[self.target_key]).to(self.classifier.device)
        if labels.numel() and not (0 <= int(labels.min()) and int(labels.max()) < len(self.classnames)):
            raise UserError(f"metric 'zero_shot': {self.target_key} must index the {len(self.classnames)} classnames; got "
                            f"labels in [{int(labels.min())}, {int(labels.max())}].")
        logits = self.model.encode_image(batch[self.image_key].to(self.classifier.device)).float() @ self.classifier.T
        top = logits.topk(min(max(self.ks), logits.shape[1]), dim=1).indices
        hit = top == labels[:, None]
        self.add("hits", "sum", torch.stack([hit[:, :k].any(1).sum() for k in self.ks]))

    def compute(self) -> dict[str, float]:
        self.require_samples()
        hits = self.state("hits").cpu()
        return {f"zero_shot_top{k}": rate(hits[i], self.samples) for i, k in enumerate(self.ks)}


@register_metric("retrieval")
class ImageTextRetrieval(TwoTowerMetric):
    """Image-text retrieval recall@k both ways, over every rank's embeddings, in blocks.

    Each sample is an image and one of its captions. ``image_id_key`` (e.g. COCO's ``image_id``)
    says which samples share an image: the gallery holds each image once, and an image's captions
    are all the captions of its id; null: every sample is its own image. ``t2i_recall@k``: the
    fraction of captions whose image ranks in the top k of all images; ``i2t_recall@k``: the
    fraction of images whose best-ranked own caption is in the top k of all captions (ties rank
    against the match, as in ``recall@k``); ``mean_recall``: their mean over both ways and every k. ``block_size`` bounds the memory: at most that many
    gallery rows arrive at once and at most ``block_size``^2 scores exist (default 4,096: 64 MB).
    """

    name = "retrieval"

    def __init__(self, k: Sequence[int] | int = (1, 5, 10), image_key: str = "image",
                 image_id_key: str | None = None, block_size: int = 4096):
        self.ks = [int(x) for x in ([k] if isinstance(k, int) else k)]
        if not self.ks or min(self.ks) < 1:
            raise UserError(f"metric 'retrieval': k must be positive integers, got {k!r}.")
        if int(block_size) < 1:
            raise UserError(f"metric 'retrieval': block_size={block_size} must be a positive number of rows.")
        self.image_key, self.image_id_key, self.block_size = image_key, image_id_key, int(block_size)
        self.required_keys = (image_key, "input_ids", "attention_mask") + ((image_id_key,) if image_id_key else ())

    def reset(self) -> None:
        super().reset()
        self.seen: set[int] = set()

    def update(self, batch: Mapping[str, Any], output: Mapping[str, Any]) -> None:
        n = self.check(batch, output)
        device = _device(self.model)
        text = self.model.encode_text(batch["input_ids"].to(device), batch["attention_mask"].to(device)).float()
        if self.image_id_key is None:
            start = int(self.samples) - n  # this rank's own numbering; made global in sync()
            keys = torch.arange(start, start + n, device=device)
        else:
            keys = torch.as_tensor(batch[self.image_id_key]).reshape(-1).long().to(device)
        new = [i for i, key in enumerate(keys.tolist()) if key not in self.seen and not self.seen.add(key)]
        self.add("text", "cat", text)
        self.add("text_keys", "cat", keys)
        if new:  # an image with several captions is encoded once per rank
            index = torch.tensor(new, device=device)
            self.add("image", "cat", self.model.encode_image(batch[self.image_key].to(device)[index]).float())
            self.add("image_keys", "cat", keys[index])

    def sync(self) -> None:
        """Nothing is gathered: :meth:`compute` ranks across the ranks itself (every rank calls both)."""

    def compute(self) -> dict[str, float]:
        device = _device(self.model)
        text = self.state("text", torch.empty((0, 0), device=device))
        image = self.state("image", torch.empty((0, 0), device=device))
        text_keys = self.state("text_keys", torch.empty(0, dtype=torch.long, device=device))
        image_keys = self.state("image_keys", torch.empty(0, dtype=torch.long, device=device))
        world, rank = comm.get_world_size(), comm.get_rank()
        dims = [d for d in comm.all_gather_object(int(text.shape[1]) if len(text) else -1) if d >= 0]
        if not dims:
            raise UserError("metric 'retrieval' got 0 samples; is the evaluation split empty?")
        text, image = text.reshape(-1, dims[0]), image.reshape(-1, dims[0])
        if self.image_id_key is None:  # rank r's i-th sample: key i * W + r, unique over the ranks
            text_keys, image_keys = text_keys * world + rank, image_keys * world + rank
        elif world > 1:  # an image seen by several ranks stays in the gallery of the first only
            held = comm.all_gather_object(image_keys.tolist())
            earlier = {k for r in range(rank) for k in held[r]}
            keep = torch.tensor([k not in earlier for k in image_keys.tolist()], dtype=torch.bool, device=device)
            image, image_keys = image[keep], image_keys[keep]
        depth = max(self.ks)
        t2i = gallery_ranks(text, text_keys, image, image_keys, depth, self.block_size)
        i2t = gallery_ranks(image, image_keys, text, text_keys, depth, self.block_size)
        counts = torch.tensor([len(t2i), len(i2t)] + [int((t2i < k).sum()) for k in self.ks]
                              + [int((i2t < k).sum()) for k in self.ks], dtype=torch.long)
        counts = comm.all_reduce(counts)
        texts, images, hits = int(counts[0]), int(counts[1]), counts[2:]
        result = {f"t2i_recall@{k}": rate(hits[i], texts) for i, k in enumerate(self.ks)}
        result.update({f"i2t_recall@{k}": rate(hits[len(self.ks) + i], images) for i, k in enumerate(self.ks)})
        result["mean_recall"] = torch.tensor(list(result.values()), dtype=torch.float64).mean().item()
        return result
