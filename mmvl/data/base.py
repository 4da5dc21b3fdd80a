"""The dataset-builder contract.

A builder owns one dataset: it creates the files on first use (``prepare``,
run on rank 0 only while the other ranks wait), builds a ``torch`` dataset per
split whose items are plain dicts, and says how to collate them. It never
knows about devices or ranks.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

from omegaconf import DictConfig
from torch.utils.data import Dataset

from mmvl.data.sample import collate
from mmvl.labels import IGNORE_INDEX


class DatasetBuilder:
    """Base class for registered datasets (``@registry.register_dataset``).

    ``config`` is ``dataset_config.<name>``; ``data_dir`` is ``env.data_dir``.
    """

    #: default YAML (relative to the repo's ``configs/``), merged before the user's file
    config_path: str | None = None
    #: ``env.cache_dir`` (set by :func:`mmvl.build.build_datasets`): where parsed splits are cached;
    #: None caches them under ``<data_dir>/.mmvl_cache`` (see :mod:`mmvl.data.cache`)
    cache_dir: str | None = None

    def __init__(self, config: DictConfig, data_dir: str):
        self.config = config
        self.data_dir = data_dir

    def prepare(self) -> None:
        """Create or check the data on disk. Called on rank 0 before ``build``."""

    def prepare_split(self, split: str) -> None:
        """Parse and cache ``split`` (and what it needs, e.g. vocabularies fitted on ``train``).

        Called for the splits a run uses, on rank 0 first while the other ranks wait; they
        then only map the cache. The default does nothing (``build`` does all the work)."""

    def check_split(self, split: str) -> None:
        """Refuse (``UserError``) a split the run uses that this builder's config cannot give, e.g.
        ``val`` with no images held out. Called for every split of the run before any training, so
        a run never fails at its first evaluation; from the config alone (cheap). The default
        accepts every split."""

    def build(self, split: str) -> Dataset:
        """Return the dataset for ``split`` (``train``, ``val`` or ``test``)."""
        raise NotImplementedError

    #: padding per key where 0 would mean something: -100 is the label the masked-LM loss ignores
    pad_values: Mapping[str, Any] = MappingProxyType({"lm_label_ids": IGNORE_INDEX})

    def collate(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        """Make a batch; the default pads variable-length tensors to the longest (``pad_values``, else 0)."""
        return collate(items, self.pad_values)

    #: ``json`` or ``csv``: the file format ``predictions`` rows are written in
    prediction_format = "json"

    def predictions(self, data: dict[str, Any], scores: Any) -> list[dict[str, Any]]:
        """One row per sample for ``predictions/<dataset>_<split>.<format>``.

        Called once per evaluation batch: ``data`` is the batch (``id`` and every
        other field, the sampler's padding removed) and ``scores`` its model
        scores; rows are written in dataset order. The default gives the arg-max
        class index.
        """
        ids = data.get("id", list(range(len(scores))))
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return [{"id": i, "answer": int(a)} for i, a in zip(ids, scores.argmax(-1).tolist())]

    def extra_metrics(self, split: str) -> dict[str, float]:
        """Dataset-level reference numbers logged with every evaluation (e.g. ``accuracy/prior``)."""
        return {}
