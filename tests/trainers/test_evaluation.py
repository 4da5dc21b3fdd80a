"""Streaming evaluation: equals the full-matrix computation, counts each sample once on 2 gloo ranks,
writes predictions in dataset order, shows progress, and prepares splits on rank 0 first."""
from __future__ import annotations

import json
import os
import time

import pytest
import torch

from mmvl import registry
from mmvl.config import load_config
from mmvl.data.base import DatasetBuilder
from mmvl.trainers import Trainer
from mmvl.trainers.evaluation import prepare_split
from tests.distributed.dist_launch import launch
from tests.fixtures.metric_reference import full_matrix_metric
from tests.fixtures.toy import HERE, ToyDataset, register, toy_opts

N_VAL = 23  # odd: a 2-rank sampler pads one duplicate


class SoftToy(torch.utils.data.Dataset):
    """Two classes with VQA-like soft targets (argmax = the label), a group per sample."""

    def __init__(self, n: int, seed: int):
        self.base = ToyDataset(n, seed)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> dict:
        item = self.base[i]
        label = item["targets"] % 2
        item["targets"] = torch.tensor([0.9, 0.3] if label == 0 else [1 / 3, 1.0])
        return item


class SoftToyBuilder(DatasetBuilder):
    config_path = os.path.join(HERE, "toy_data.yaml")

    def build(self, split: str) -> SoftToy:
        return SoftToy(64 if split == "train" else N_VAL, seed={"train": 0, "val": 1, "test": 2}[split])

    def model_info(self) -> dict:
        return {"num_labels": 2}


class OrderedBuilder(DatasetBuilder):
    """Records the order in which ranks prepare splits (the file system is their shared clock)."""

    def __init__(self, config, data_dir):
        super().__init__(config, data_dir)
        self.root = data_dir

    def prepare_split(self, split: str) -> None:
        from mmvl.distributed import comm

        marker = os.path.join(self.root, f"{split}.built")
        if comm.get_rank() == 0:
            time.sleep(1.0)  # a slow build: rank 1 must still wait for it
            with open(marker, "w") as f:
                f.write(str(time.time()))
        else:
            with open(os.path.join(self.root, f"{split}.rank1"), "w") as f:
                f.write(str(os.path.exists(marker)))


def _register() -> None:
    register()
    if "soft_toy" not in registry.DATASETS:
        registry.DATASETS.register("soft_toy", SoftToyBuilder)


_register()
SOFT_METRICS = ("[{type: accuracy, params: {group_key: question_family}}, vqa_accuracy, binary_f1, macro_f1, "
                "roc_auc]")
INDEX_METRICS = "[{type: accuracy, params: {group_key: question_family}}, macro_f1, {type: recall@k, " \
                "params: {k: [1, 2], i2t: true}}]"


def _opts(root: str, soft: bool, *extra: str) -> list[str]:
    opts = toy_opts(root, "run_type=val", "evaluation.predict=true", "training.batch_size=6",
                    "dataset_config.toy.num_val=23")
    if soft:
        opts = [o.replace("datasets=toy", "datasets=soft_toy") for o in opts]
        opts += ["model_config.toy_mlp.losses=[{type: logit_bce}]", f"evaluation.metrics={SOFT_METRICS}"]
    else:
        opts += [f"evaluation.metrics={INDEX_METRICS}", "dataset_config.toy.metrics=[]"]
    return opts + list(extra)


def _evaluate(env, root: str) -> dict:
    _register()
    torch.set_num_threads(1)
    out = {}
    for soft in (False, True):
        trainer = Trainer(load_config(_opts(f"{root}/{'soft' if soft else 'index'}", soft)), env=env)
        out["soft" if soft else "index"] = trainer.evaluate("val")
    return out


def _reference(trainer: Trainer, soft: bool) -> dict[str, float]:
    """The earlier evaluation: scores of the whole split at once, then the full-matrix formulas."""
    name = "soft_toy" if soft else "toy"
    ds = trainer.builders[name].build("val")
    batch = trainer.builders[name].collate([ds[i] for i in range(len(ds))])
    trainer.model.eval()
    with torch.no_grad():
        scores = trainer.model(batch)["scores"].float()
    groups = [str(g) for g in batch["question_family"].tolist()]
    out = {}
    names = ["accuracy", "vqa_accuracy", "binary_f1", "macro_f1", "roc_auc"] if soft else \
        ["accuracy", "macro_f1", "recall@k"]
    for metric in names:
        params = {"groups": groups} if metric == "accuracy" else {"k": [1, 2]} if metric == "recall@k" else {}
        out.update(full_matrix_metric(metric, params, batch["targets"], scores))
    loss = registry.LOSSES.get("logit_bce" if soft else "cross_entropy")()
    out["loss"] = loss(batch, {"scores": scores}).item()
    return out


@pytest.mark.parametrize("soft", [False, True])
def test_streaming_evaluation_equals_the_full_matrix_computation(tmp_path, soft, capsys):
    trainer = Trainer(load_config(_opts(str(tmp_path), soft)))
    got = trainer.evaluate("val")["soft_toy" if soft else "toy"]
    logged = capsys.readouterr().out  # the mmvl logger prints through tqdm.write
    expected = _reference(trainer, soft)
    loss = expected.pop("loss")
    assert {k: got[k] for k in expected} == expected  # exact
    assert got["total_loss"] == pytest.approx(loss, rel=1e-6)
    assert f"evaluated {N_VAL} samples" in logged and "samples/s" in logged
    rows = json.loads((tmp_path / "save" / "predictions" / f"{'soft_toy' if soft else 'toy'}_val.json").read_text())
    assert [r["id"] for r in rows] == list(range(N_VAL))
    assert not [p for p in os.listdir(tmp_path / "save" / "predictions") if p.startswith(".")]


@pytest.mark.proc
def test_two_ranks_equal_one(tmp_path):
    one = {}
    for soft in (False, True):
        t = Trainer(load_config(_opts(str(tmp_path / "one" / ("soft" if soft else "index")), soft)))
        one["soft" if soft else "index"] = t.evaluate("val")
    two = launch(_evaluate, world_size=2, args=(str(tmp_path / "two"),), timeout=300)
    for rank in range(2):
        for kind in ("index", "soft"):
            for name, values in one[kind].items():
                got = two[rank][kind][name]
                losses = {k for k in values if k in ("total_loss", "cross_entropy", "logit_bce")}
                assert {k: v for k, v in got.items() if k not in losses} == \
                    {k: v for k, v in values.items() if k not in losses}, (rank, kind)
                for k in losses:
                    assert got[k] == pytest.approx(values[k], rel=1e-6)
    for kind, name in (("index", "toy"), ("soft", "soft_toy")):
        a = (tmp_path / "one" / kind / "save" / "predictions" / f"{name}_val.json").read_text()
        b = (tmp_path / "two" / kind / "save" / "predictions" / f"{name}_val.json").read_text()
        assert a == b and len(json.loads(a)) == N_VAL


def test_progress_bar_on_a_terminal(tmp_path, capsys, monkeypatch):
    trainer = Trainer(load_config(_opts(str(tmp_path), False, "training.progress_bar=true")))
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    trainer.evaluate("val")
    err = capsys.readouterr().err
    assert "eval val toy" in err and f"{N_VAL}/{N_VAL}" in err and "100%" in err


def _prepare_on_two_ranks(env, root: str) -> dict:
    """Both ranks prepare a slow fake split, then hateful_memes' train split; rank 0 must go first."""
    from omegaconf import OmegaConf

    import mmvl.data.datasets  # noqa: F401
    from mmvl.data.cache import Cache

    prepare_split({"ordered": OrderedBuilder(None, root)}, "val", env.is_main_process)
    built = []
    original = Cache._build

    def counting(self, path, build, what):
        built.append(what)
        return original(self, path, build, what)

    Cache._build = counting
    cfg = OmegaConf.load(os.path.join(os.path.dirname(HERE), "..", "configs", "datasets", "hateful_memes.yaml"))
    builder = registry.DATASETS.get("hateful_memes")(cfg.dataset_config.hateful_memes, root)
    prepare_split({"hateful_memes": builder}, "train", env.is_main_process)
    return {"built": built, "ids": builder.records("train").column("id").tolist()}


@pytest.mark.proc
def test_rank_zero_prepares_and_caches_while_the_others_wait(tmp_path):
    from tests.fixtures.vl_data import write_hateful_memes

    write_hateful_memes(tmp_path)
    ranks = launch(_prepare_on_two_ranks, world_size=2, args=(str(tmp_path),), timeout=120)
    assert (tmp_path / "val.built").is_file()
    assert (tmp_path / "val.rank1").read_text() == "True"  # rank 1 ran only after rank 0 had finished
    # rank 0 parsed and cached; rank 1 only mapped what it wrote
    assert ranks[0]["built"] == ["train split", "text_processor vocabulary"] and ranks[1]["built"] == []
    assert ranks[0]["ids"] == ranks[1]["ids"] == list(range(1000, 1008))
